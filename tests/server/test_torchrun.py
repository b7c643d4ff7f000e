"""`conveyor serve --tensor-parallel-size 2` under torchrun (the multi-node launch, here with both
ranks on this machine): rank 0 serves HTTP, rank 1 only runs its slice; answers equal TP=1's."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest import free_port, wait_healthy

pytestmark = pytest.mark.slow

TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.mark.skipif(not TORCHRUN.exists() and shutil.which("torchrun") is None, reason="no torchrun")
def test_tensor_parallel_under_torchrun(tmp_path, demo_model):
    from conveyor.engine.engine import Engine, EngineConfig
    from conveyor.sampling.params import SamplingParams

    engine = Engine(EngineConfig.from_options(dtype="float32", num_kv_blocks=64, cost_model="none"), loaded=demo_model)
    rid = engine.add_request("The capital of France is", SamplingParams(max_tokens=12, temperature=0))
    want = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                want = out.outputs[0].text

    port = free_port()
    log = tmp_path / "torchrun.log"
    cmd = [str(TORCHRUN if TORCHRUN.exists() else shutil.which("torchrun")), "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "conveyor", "serve",
           "--tensor-parallel-size", "2", "--dtype", "float32", "--num-kv-blocks", "64", "--port", str(port),
           "--cost-model", "none", "--log-interval", "0", "--torch-threads", "1"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", log, 600)   # generous: a busy machine
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        os.killpg(proc.pid, signal.SIGTERM)   # what a scheduler's stop does: every rank and torchrun
        proc.wait(timeout=60)   # torchrun itself exits 1 on a signal (its SignalException), whatever the ranks did
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    assert "Application shutdown complete" in text and "Finished server process" in text
    assert not re.search(r'File ".*/conveyor/', text), text   # no traceback through Conveyor's code on any rank
