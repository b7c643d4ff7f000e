"""The core -> front-end seam: per-sequence deltas that do not grow with the output, validation
once in the front end, stop strings found there ending the sequence in the core as a stop."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

import conveyor.frontend.inputs as inputs_mod
from conveyor.transport.thread import AsyncEngine
from conveyor.core.engine_core import idle_violations
from conveyor.frontend.inputs import InvalidRequestError
from conveyor.core.wire import StepResults, decode_result, encode
from conveyor.sampling.params import SamplingParams


def test_a_step_sends_only_the_new_token_of_each_sequence(make_engine):
    """Bytes per step over the seam stay flat as the outputs grow (they used to carry the whole
    text, token ids and latencies of every request, every step)."""
    engine = make_engine()
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True, logprobs=2)
    for i in range(4):
        engine.add_request([5 + i, 6, 7, 8], params)
    sizes, tokens = [], 0
    while engine.has_unfinished_requests():
        updates = engine.run_step()
        outputs, stops = engine.frontend.process(updates)
        assert not stops
        if updates and all(u.token_id is not None and u.finish_reason is None for u in updates):
            assert all(u.metrics is None for u in updates) or tokens == 0   # metrics: first token and finish only
            sizes.append(len(msgspec.msgpack.encode(updates)))   # as they cross the process pipe
        tokens += len(updates)
    assert tokens == 4 * 300 and len(sizes) > 250
    early, late = sizes[1:20], sizes[-20:]
    assert max(late) <= max(early) + 16, (early, late)   # flat: a few bytes of int width at most
    assert not idle_violations(engine.scheduler)


def test_validation_runs_once_per_request(make_engine, monkeypatch):
    calls = []
    real = inputs_mod.validate_request
    monkeypatch.setattr(inputs_mod, "validate_request", lambda *a, **k: calls.append(1) or real(*a, **k))
    engine = make_engine()
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    assert len(calls) == 1
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request([10 ** 6], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished_requests() or len(engine.scheduler.requests) == 1

    client = AsyncEngine(make_engine())

    async def main():
        p = SamplingParams(max_tokens=3, ignore_eos=True)
        processed = client.inputs.process([4, 5, 6], p)     # the server's one check (process_request) ...
        stream = client.add_request(processed, None, "a")   # ... is not repeated here
        outs = [o async for o in stream]
        with pytest.raises(InvalidRequestError):            # raw input is processed (and checked) at add
            client.add_request([], p, "b")
        return outs

    calls.clear()
    outs = asyncio.run(main())
    client.close(timeout=5)
    assert len(calls) == 2 and outs[-1].outputs[0].finish_reason == "length"


def test_a_stop_string_found_in_the_front_end_stops_the_core_sequence(make_engine):
    engine = make_engine()
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    rid = engine.add_request([9, 10, 11], free)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                text = out.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    finished = engine.scheduler.stats.num_finished
    engine.add_request([9, 10, 11], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))
    final = None
    while engine.has_unfinished_requests():   # the deltas cross the wire, as between two processes
        frame = encode(StepResults(updates=engine.run_step(), stats=engine.stats(), applied_seqs=0))
        outputs, finishes = engine.frontend.process(decode_result(frame).updates)
        for command in finishes:
            engine.finish(command)
        final = next((o for o in outputs if o.finished), final)
    c = final.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop and text.startswith(c.text) and stop not in c.text
    assert len(c.token_ids) < 40
    m = final.metrics[0]   # ended by the front end: its own metrics, complete (not the first token's)
    assert m.finished_time is not None and m.finished_time >= m.last_token_time
    assert len(m.inter_token_latencies) == len(c.token_ids) - 1
    # the core ended it as a stop (counted, observed by admission), not as an abort; nothing leaks
    assert engine.scheduler.stats.num_finished == finished + 1 and engine.scheduler.stats.num_aborted == 0
    assert not engine.scheduler.requests and not idle_violations(engine.scheduler)
    assert rid not in engine.frontend
