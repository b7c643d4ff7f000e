"""The engine loop in its own process: the same streams, aborts and shutdown as the thread version,
and a child that dies is reported, not waited for."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from conveyor.config import EngineConfig
from conveyor.frontend.client import Overloaded
from conveyor.core.engine_core import EngineDeadError
from conveyor.engine.engine import Engine
from conveyor.transport.process import ProcessEngine
from conveyor.errors import InvalidRequestError
from conveyor.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
CONFIG = EngineConfig.from_options(dtype="float32", num_kv_blocks=64, max_num_seqs=8, cost_model="none")


async def drain(stream) -> list:
    return [out async for out in stream]


@pytest.fixture(scope="module")
def offline(demo_model):
    engine = Engine(CONFIG, loaded=demo_model)
    engine.add_request("The capital of France is", GREEDY)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out


def test_streams_match_the_in_process_engine_and_shutdown_is_clean(offline):
    engine = ProcessEngine(CONFIG, max_waiting=4)
    assert engine.is_healthy and engine.model_name == "SmolLM2-135M-Instruct" and engine.max_model_len == 1024
    # the model's default sampling parameters come across from the engine process (the demo's: greedy)
    assert engine.generation_defaults == {"temperature": 0.0}
    assert engine.frontend.inputs.default_params == SamplingParams(temperature=0.0)

    async def main():
        first = await drain(engine.add_request("The capital of France is", GREEDY, "a"))
        with pytest.raises(InvalidRequestError, match="empty"):   # the front end (this process) validates
            engine.add_request([], GREEDY, "empty")
        long = engine.add_request("Tell me a story", SamplingParams(max_tokens=500, ignore_eos=True), "long")
        await asyncio.sleep(0.3)
        engine.abort("long")
        aborted = await drain(long)
        return first, aborted

    first, aborted = asyncio.run(main())
    assert first[-1].outputs[0].token_ids == offline.outputs[0].token_ids
    assert "".join(o.outputs[0].delta_text for o in first) == offline.outputs[0].text
    assert aborted[-1].outputs[0].finish_reason == "abort"
    stats = engine.stats()
    assert stats.num_running == 0 and stats.kv_usage == 0.0 and stats.num_aborted == 1
    engine.inputs.process([1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        engine.inputs.process([10 ** 9], GREEDY)
    engine.close(timeout=5)
    assert not engine.is_healthy and engine._proc.exitcode == 0


def test_max_waiting_is_counted_before_the_child_sees_the_requests():
    engine = ProcessEngine(CONFIG, max_waiting=2)

    async def main():
        streams = [engine.add_request("hello", GREEDY, f"r{i}") for i in range(2)]
        with pytest.raises(Overloaded):
            engine.add_request("hello", GREEDY, "r2")
        return [await drain(s) for s in streams]

    outs = asyncio.run(main())
    assert all(o[-1].outputs[0].finish_reason == "length" for o in outs)
    engine.close()


def test_a_killed_engine_process_fails_open_streams_and_refuses_new_ones():
    engine = ProcessEngine(CONFIG)

    async def main():
        stream = engine.add_request("Tell me a story", SamplingParams(max_tokens=1000, ignore_eos=True), "x")
        await asyncio.sleep(0.5)
        os.kill(engine._proc.pid, signal.SIGKILL)
        outs = await asyncio.wait_for(drain(stream), timeout=30)
        with pytest.raises(EngineDeadError):
            engine.add_request("hi", GREEDY, "y")
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and "exited unexpectedly" in outs[-1].error
    assert not engine.is_healthy and "exited unexpectedly" in engine.dead_reason
    engine.close()


def test_a_program_that_never_closes_its_engine_still_exits(tmp_path):
    """The engine process is not a daemon (it may spawn tensor-parallel ranks): at exit the parent
    closes its command pipe, so multiprocessing's join of the child returns instead of hanging."""
    import subprocess
    import sys

    script = tmp_path / "forget.py"
    script.write_text(
        "from conveyor.config import EngineConfig\n"
        "from conveyor.transport.process import ProcessEngine\n"
        "if __name__ == '__main__':\n"
        "    ProcessEngine(EngineConfig.from_options(dtype='float32', num_kv_blocks=16, cost_model='none'))\n"
        "    print('started', flush=True)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "started" in done.stdout and "Traceback" not in done.stderr, done.stderr


def test_a_request_that_cannot_cross_the_pipe_is_refused_and_leaves_nothing_behind():
    engine = ProcessEngine(CONFIG)

    async def main():
        bad = SamplingParams(max_tokens=4, logits_processors=[lambda ids, row: row])
        with pytest.raises(InvalidRequestError, match="cannot be sent to the engine process"):
            engine.add_request("hello", bad, "bad")
        assert "bad" not in engine.frontend and not engine._shared.streams and engine._shared.pending_seqs == 0
        return await drain(engine.add_request("hello", GREEDY, "bad"))   # the id is free again

    outs = asyncio.run(main())
    assert outs[-1].outputs[0].finish_reason == "length" and engine.stats().num_waiting == 0
    engine.close(timeout=5)


def test_an_engine_process_of_another_wire_version_is_refused(monkeypatch):
    """The child checks the front end's wire version before it loads anything, and says why."""
    import conveyor.transport.process as pe

    monkeypatch.setattr(pe, "WIRE_VERSION", pe.WIRE_VERSION + 1)
    with pytest.raises(RuntimeError, match=r"could not start: WireError: the front end speaks wire version"):
        ProcessEngine(CONFIG)
