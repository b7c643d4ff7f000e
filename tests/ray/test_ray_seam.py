"""What crosses the Ray seam between an engine replica and the ingress (``conveyor.ray.serve``): a
running request's outputs as what each adds (never the prompt, the text so far or the replica's stats
on every item), the finished output whole; the ingress rebuilds exactly the outputs the replica's
front end made. Driven through ``EngineReplica.generate`` with a stand-in engine, each item pickled as
Serve ships it. No cluster."""

from __future__ import annotations

import asyncio
import pickle

import pytest

pytest.importorskip("ray")

from conveyor.core.stats import EngineStats  # noqa: E402
from conveyor.frontend.inputs import ProcessedRequest  # noqa: E402
from conveyor.frontend.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from conveyor.ray import serve as ray_serve  # noqa: E402
from conveyor.ray.serve import EngineReplica, OutputRebuilder, ReplicaDelta, ReplicaOutput  # noqa: E402
from conveyor.sampling.params import SamplingParams  # noqa: E402

PROMPT = list(range(500, 700))   # a long prompt: it must not ride every item
PIECES = [(" The", 11), (" sea", 12), (" is", 13), (" wide", 14), (".", 15)]


def engine_outputs(request_id: str) -> list[RequestOutput]:
    """A 2-sequence request as the front end streams it: cumulative text, deltas, prompt logprobs from
    the first output on, the whole sequences on the finished one (sequence 1 stops a step early)."""
    plp = [None] + [{t: Logprob(-1.0, 1)} for t in PROMPT[1:]]
    outs, texts, ids = [], ["", ""], [[], []]
    for step, (piece, tok) in enumerate(PIECES):
        done = step == len(PIECES) - 1
        comps = []
        for i in (0, 1):
            stopped = i == 1 and step >= len(PIECES) - 2
            add = "" if (i == 1 and step == len(PIECES) - 1) else piece
            texts[i] += add
            ids[i] += [tok] if add else []
            comps.append(CompletionOutput(i, texts[i], list(ids[i]) if done else None, None,
                                          "stop" if stopped else ("length" if done else None),
                                          "." if stopped else None, add, (tok,) if add else (), None, None))
        outs.append(RequestOutput(request_id, "a prompt", PROMPT, comps, done, prompt_logprobs=plp,
                                  num_cached_tokens=32))
    return outs


class _Stream:
    def __init__(self, outs):
        self.outs, self.finished = list(outs), False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.outs:
            raise StopAsyncIteration
        out = self.outs.pop(0)
        self.finished = out.finished
        return out


class _Engine:
    def __init__(self):
        self.stats_calls = 0

    def add_request(self, request, params, request_id, priority):
        return _Stream(engine_outputs(request_id))

    def stats(self):
        self.stats_calls += 1
        return EngineStats(steps=self.stats_calls, num_running=1)

    def abort(self, request_id):
        raise AssertionError("a finished stream is not aborted")

    def close(self):
        pass


def _replica() -> EngineReplica:
    replica = object.__new__(EngineReplica)   # the engine stood in for: no Serve replica context needed
    replica.tag, replica.engine, replica._stats_sent = "replica-a", _Engine(), 0.0
    return replica


async def _items(replica: EngineReplica, request_id: str) -> list:
    request = ProcessedRequest("a prompt", PROMPT, SamplingParams(n=2))
    return [pickle.loads(pickle.dumps(item)) async for item in replica.generate(request, request_id, 0)]


def test_replica_streams_deltas_and_the_ingress_rebuilds_the_outputs():
    replica = _replica()
    items = asyncio.run(_items(replica, "req-1"))
    expected = engine_outputs("req-1")
    assert [type(i) for i in items] == [ReplicaDelta] * 4 + [ReplicaOutput]
    # the tag on the first item; stats on the first and the last (these ran within a second)
    assert [i.replica for i in items] == ["replica-a", None, None, None, "replica-a"]
    assert [i.stats is not None for i in items] == [True, False, False, False, True]
    assert [i.prompt_logprobs is not None for i in items[:4]] == [True, False, False, False]
    # what a running item weighs does not grow with the prompt or with what was generated before
    sizes = [len(pickle.dumps(i)) for i in items[1:4]]
    assert max(sizes) < 400 and max(sizes) - min(sizes) < 40, sizes
    rebuild = OutputRebuilder("req-1", ProcessedRequest("a prompt", PROMPT, SamplingParams(n=2)))
    got = [rebuild(i) if isinstance(i, ReplicaDelta) else i.output for i in items]
    for g, want in zip(got, expected):
        assert (g.request_id, g.prompt, g.prompt_token_ids, g.finished) == \
            (want.request_id, want.prompt, want.prompt_token_ids, want.finished)
        assert g.num_cached_tokens == want.num_cached_tokens and g.prompt_logprobs == want.prompt_logprobs
        for c, w in zip(g.outputs, want.outputs):
            assert (c.index, c.text, c.delta_text, c.delta_token_ids, c.finish_reason, c.stop_reason) == \
                (w.index, w.text, w.delta_text, w.delta_token_ids, w.finish_reason, w.stop_reason)
    assert got[-1].outputs[0].token_ids == [11, 12, 13, 14, 15]   # the finished output, whole


def test_stats_ride_at_most_once_per_interval_between_first_and_last(monkeypatch):
    replica = _replica()
    clock = iter(range(0, 1000, 1))   # each look at the clock is 1 s later
    monkeypatch.setattr(ray_serve.time, "monotonic", lambda: float(next(clock)))
    items = asyncio.run(_items(replica, "req-2"))
    assert all(i.stats is not None for i in items)   # a second apart each: every item may carry them
    monkeypatch.setattr(ray_serve.time, "monotonic", lambda: 5.0)
    replica._stats_sent = 0.0
    items = asyncio.run(_items(replica, "req-3"))   # no time passes: first and last only
    assert [i.stats is not None for i in items] == [True, False, False, False, True]
