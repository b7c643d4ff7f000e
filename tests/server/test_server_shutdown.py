"""`conveyor serve` as a real process: SIGTERM mid-stream shuts it down cleanly (exit 0); a second one exits at once."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from conftest import free_port, wait_healthy

pytestmark = pytest.mark.slow


@dataclass
class Served:
    proc: subprocess.Popen
    url: str
    output: str = ""   # the server's log, once it has stopped


@contextlib.contextmanager
def serve(tmp_path, shutdown_timeout: float) -> Iterator[Served]:
    """`conveyor serve` on a free port, up and healthy; killed on exit if still running."""
    port = free_port()
    path = tmp_path / "serve.log"
    with open(path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "conveyor", "serve", "--port", str(port), "--num-kv-blocks", "64",
             "--max-num-seqs", "4", "--shutdown-timeout", str(shutdown_timeout), "--log-interval", "1"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    served = Served(proc, f"http://127.0.0.1:{port}")
    try:
        wait_healthy(proc, served.url, path, 600)   # a start, not a speed: generous on a busy machine
        yield served
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        served.output = path.read_text()


def test_sigterm_graceful_shutdown(tmp_path):
    with serve(tmp_path, 3) as s:
        body = {"prompt": "Tell me a story.", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=60) as r:
            events = (line for line in r.iter_lines() if line.startswith("data:"))
            next(events), next(events)
            s.proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            # In-flight work may go on until the shutdown timeout, then the stream ends cleanly.
            rest = list(events)
        assert rest and rest[-1] == "data: [DONE]"
        assert s.proc.wait(timeout=30) == 0
        assert time.monotonic() - sent < 20
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{s.url}/health", timeout=2)
    assert "Application startup complete" in s.output and "Traceback" not in s.output
    assert "generation" in s.output and "tok/s" in s.output   # the periodic stats line


def test_second_signal_during_the_drain_exits_at_once(tmp_path):
    """The first SIGTERM starts a drain that could last 120 s; the second one ends the process now."""
    with serve(tmp_path, 120) as s:
        body = {"prompt": "Tell me a story.", "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=60) as r:
            events = (line for line in r.iter_lines() if line.startswith("data:"))
            next(events)
            s.proc.send_signal(signal.SIGTERM)
            time.sleep(1.0)
            assert s.proc.poll() is None   # draining: the stream still runs
            s.proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            assert s.proc.wait(timeout=10) == 128 + signal.SIGTERM
            assert time.monotonic() - sent < 5
    assert "SIGTERM during the graceful shutdown: exiting now" in s.output
