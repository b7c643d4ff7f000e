"""AsyncEngine on its own: streams, abort at any time, bounded waiting, graceful shutdown."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from conveyor.core.engine_core import EngineDeadError

from conveyor.frontend.client import Overloaded

from conveyor.transport.thread import AsyncEngine
from conveyor.engine.engine import Engine, EngineConfig
from conveyor.errors import InvalidRequestError
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler.config import SchedulerConfig

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)


def make(demo_model, max_waiting=None, max_num_seqs=8) -> AsyncEngine:
    config = EngineConfig(num_kv_blocks=64, block_size=16,
                          scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256))
    return AsyncEngine(Engine(config, loaded=demo_model), max_waiting=max_waiting)


async def drain(stream) -> list:
    return [out async for out in stream]


def test_stream_matches_offline_engine(demo_model):
    offline = Engine(EngineConfig(num_kv_blocks=64, block_size=16), loaded=demo_model)
    offline.add_request("Hello there", GREEDY)
    expected = None
    while offline.has_unfinished_requests():
        for out in offline.step():
            expected = out
    engine = make(demo_model)

    async def main():
        outs = await drain(engine.add_request("Hello there", GREEDY, "r1"))
        await engine.shutdown()
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    assert outs[-1].outputs[0].token_ids == expected.outputs[0].token_ids
    assert "".join(o.outputs[0].delta_text for o in outs) == expected.outputs[0].text
    assert not engine.is_healthy   # shut down


def test_abort_before_and_during_run_frees_blocks(demo_model):
    engine = make(demo_model)

    async def main():
        early = engine.add_request("Never runs", LONG, "early")
        engine.abort("early")
        late = engine.add_request("Runs a bit", LONG, "late")
        first = await late.__anext__()
        assert not first.finished and engine.stats().kv_usage > 0
        engine.abort("late")
        rest = await drain(late)
        early_outs = await drain(early)
        return rest, early_outs

    rest, early_outs = asyncio.run(main())
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert early_outs[-1].outputs[0].finish_reason == "abort"
    deadline = time.monotonic() + 60
    while engine.stats().num_running and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = engine.stats()
    assert stats.kv_usage == 0.0 and stats.num_running == stats.num_waiting == 0
    assert stats.num_unfinished_requests == 0
    engine.close()


def test_overloaded_when_waiting_is_full(demo_model):
    engine = make(demo_model, max_waiting=2, max_num_seqs=1)

    async def main():
        streams = [engine.add_request("a", GREEDY, "a"), engine.add_request("b", GREEDY, "b")]
        with pytest.raises(Overloaded):
            engine.add_request("c", GREEDY, "c")
        outs = [await drain(s) for s in streams]
        # Once the queue drains, requests are accepted again.
        outs.append(await drain(engine.add_request("d", GREEDY, "d")))
        await engine.shutdown()
        return outs

    outs = asyncio.run(main())
    assert all(o[-1].outputs[0].finish_reason == "length" for o in outs)


def test_shutdown_lets_requests_finish_then_aborts(demo_model):
    engine = make(demo_model)

    async def main():
        short = engine.add_request("short", GREEDY, "short")
        long = engine.add_request("long", LONG, "long")
        graceful = asyncio.create_task(engine.shutdown(timeout=120))
        await asyncio.sleep(0)   # lets the task start the shutdown: from then on nothing new is accepted
        assert not engine.is_healthy
        with pytest.raises(EngineDeadError):
            engine.add_request("late", GREEDY, "late")
        short_outs = await drain(short)
        first_long = await long.__anext__()   # still running once the short one is done
        assert not first_long.finished and not graceful.done()
        # The grace period ends: a second shutdown's earlier deadline (now) aborts what is left.
        await engine.shutdown(timeout=0)
        await graceful
        return short_outs, [first_long, *await drain(long)]

    short, long = asyncio.run(main())
    assert short[-1].outputs[0].finish_reason == "length" and len(short[-1].outputs[0].token_ids) == 6
    assert long[-1].outputs[0].finish_reason == "abort"
    assert not engine.is_healthy and engine.stats().num_unfinished_requests == 0


def test_invalid_request_ends_with_error(demo_model):
    engine = make(demo_model)

    async def main():
        with pytest.raises(InvalidRequestError, match="empty"):   # validated in the front end: nothing queued
            engine.add_request([], GREEDY, "empty")
        dup = engine.add_request("x", LONG, "same")
        with pytest.raises(ValueError, match="duplicate"):   # refused at once; the first runs on
            engine.add_request("x", GREEDY, "same")
        engine.abort("same")
        first = await drain(dup)
        await engine.shutdown()
        return first

    first = asyncio.run(main())
    assert first[-1].outputs[0].finish_reason == "abort"
    assert engine.stats().num_aborted == 1 and engine.stats().num_kv_blocks == engine.stats().num_free_kv_blocks


def test_idle_loop_sleeps(demo_model):
    engine = make(demo_model)

    def cpu() -> float:   # the engine thread's CPU seconds, from /proc
        fields = open(f"/proc/self/task/{engine._thread.native_id}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    async def one():
        return await drain(engine.add_request("hi", GREEDY, "x"))

    asyncio.run(one())
    deadline = time.monotonic() + 60
    while engine.stats().num_unfinished_requests and time.monotonic() < deadline:   # the step's tail done
        time.sleep(0.05)
    time.sleep(0.1)
    before = cpu()
    time.sleep(1.0)
    assert cpu() - before < 0.05   # waiting on the condition, not spinning
    engine.close()
