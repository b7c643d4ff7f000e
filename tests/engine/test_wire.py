"""The typed wire between a front end and an engine loop (conveyor/core/wire.py): every message
comes back as what was sent, typed to the field (no dict where a declared type was sent), and
anything that is not one of this version's messages is refused."""

from __future__ import annotations

import msgspec
import pytest

from conveyor.core.stats import EngineStats
from conveyor.core.wire import (WIRE_VERSION, Closed, EngineRequest, Finish, LoopFailed, Ready, Shutdown,
                                  StartFailed, StepResults, WireError, check_version, decode_command,
                                  decode_result, encode)
from conveyor.errors import InvalidRequestError
from conveyor.request import RequestMetrics, RequestStatus
from conveyor.sampling.params import SamplingParams
from conveyor.sampling.structured import StructuredOutputsParams
from conveyor.scheduler.output import LogprobEntry


def _request(**params) -> EngineRequest:
    return EngineRequest(request_id="r-1", prompt_token_ids=[5, 6, 7], params=SamplingParams(**params),
                         seq_ids=["seq-1", "seq-2"], seeds=[11, 12], priority=-3, arrival_time=12.5,
                         cache_salt="tenant-a")


@pytest.mark.parametrize("params", [
    {},
    {"n": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 3, "stop": "END", "stop_token_ids": [9],
     "logit_bias": {17: -100.0, 3: 2.5}, "allowed_token_ids": [1, 2, 3, 17], "bad_words_token_ids": [[4, 5]],
     "logprobs": 5, "prompt_logprobs": 2, "max_tokens": None, "min_tokens": 2, "eos_token_ids": (2, 0),
     "max_queue_time": 1.5, "truncate_prompt_tokens": 100, "detokenize": False},
    {"structured_outputs": StructuredOutputsParams(json={"type": "object", "required": ["a"]})},
    {"structured_outputs": StructuredOutputsParams(choice=["yes", "no"])},
    {"structured_outputs": StructuredOutputsParams(json=True)},
])
def test_a_request_crosses_unchanged(params):
    sent = _request(**params)
    got = decode_command(encode(sent))
    assert got == sent and type(got) is EngineRequest and type(got.params) is SamplingParams
    assert type(got.params.eos_token_ids) is tuple
    so = got.params.structured_outputs
    assert so is None or type(so) is StructuredOutputsParams
    assert all(type(k) is int for k in (got.params.logit_bias or {}))


def test_commands_and_results_round_trip_typed(make_engine):
    for command in (Finish(seq_ids=["seq-1"], status=RequestStatus.FINISHED_STOPPED, reason="###"),
                    Finish(seq_ids=["seq-2", "seq-3"], report=True), Finish(seq_ids=["seq-4"], reason=7),
                    Shutdown(deadline=123.25)):
        assert decode_command(encode(command)) == command
    # a real step's deltas: tokens, their logprobs, the prompt's logprobs, metrics, finishes
    engine = make_engine()
    engine.add_request([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2,
                                                    prompt_logprobs=1))
    engine.add_request([9, 10], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    seen = 0
    while engine.has_unfinished_requests():
        sent = StepResults(updates=engine.run_step(), stats=engine.stats(), applied_seqs=2)
        got = decode_result(encode(sent))
        assert got == sent
        for u in got.updates:
            assert u.logprobs is None or type(u.logprobs) is LogprobEntry
            assert u.metrics is None or type(u.metrics) is RequestMetrics
            assert all(e is None or type(e) is LogprobEntry for e in u.prompt_logprobs or ())
            seen += u.prompt_logprobs is not None
        assert type(got.stats) is EngineStats and type(got.stats.kv_group_windows) is tuple
        engine.frontend.process(got.updates)
    assert seen == 1
    stats = engine.stats()
    for result in (Ready(wire_version=WIRE_VERSION, model_name="m", max_model_len=1024, vocab_size=49152,
                         dtype="float32", eos_token_ids=[2], generation_defaults={"temperature": 0.0, "top_k": 20},
                         stats=stats),
                   StartFailed(message="no model"), LoopFailed(message="boom", engine_dead=True), Closed()):
        assert decode_result(encode(result)) == result


def test_what_is_not_a_message_of_this_version_is_refused():
    with pytest.raises(WireError, match="not a command"):
        decode_command(msgspec.msgpack.encode({"type": "reboot"}))           # an unknown kind
    with pytest.raises(WireError, match="not a command"):
        decode_command(encode(Closed()))                                       # a result is not a command
    with pytest.raises(WireError, match="not a result"):
        decode_result(encode(_request()))                                      # ... nor a command a result
    with pytest.raises(WireError):
        decode_command(msgspec.msgpack.encode({"type": "finish", "seq_ids": "seq-1"}))   # a field of another type
    with pytest.raises(WireError):
        decode_result(b"\xc1")                                                 # not msgpack at all
    check_version(WIRE_VERSION, "peer")
    with pytest.raises(WireError, match=f"speaks wire version {WIRE_VERSION + 1}"):
        check_version(WIRE_VERSION + 1, "the engine process")


def test_a_request_that_cannot_cross_is_a_clear_request_error():
    """Offline-only callables (logits_processors) cannot reach another process: refused by name."""
    with pytest.raises(InvalidRequestError, match="cannot be sent to the engine process") as e:
        encode(_request(logits_processors=[lambda ids, row: row]))
    assert e.value.param == "logits_processors"
