"""`conveyor serve` as a real process: SIGTERM mid-stream shuts it down cleanly (exit 0); a second one exits at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from conftest import free_port

pytestmark = pytest.mark.slow


def start(tmp_path, shutdown_timeout: float) -> tuple[subprocess.Popen, str, object]:
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "conveyor", "serve", "--port", str(port), "--num-kv-blocks", "64",
         "--max-num-seqs", "4", "--shutdown-timeout", str(shutdown_timeout), "--log-interval", "1"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url, log
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.2)


def test_sigterm_graceful_shutdown(tmp_path):
    proc, url, log = start(tmp_path, 3)
    try:
        body = {"prompt": "Tell me a story.", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            events = (line for line in r.iter_lines() if line.startswith("data:"))
            next(events), next(events)
            proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            # In-flight work may go on until the shutdown timeout, then the stream ends cleanly.
            rest = list(events)
        assert rest and rest[-1] == "data: [DONE]"
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - sent < 20
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.seek(0)
        output = log.read()
        log.close()
    assert "Application startup complete" in output and "Traceback" not in output
    assert "generation" in output and "tok/s" in output   # the periodic stats line


def test_second_signal_during_the_drain_exits_at_once(tmp_path):
    """The first SIGTERM starts a drain that could last 120 s; the second one ends the process now."""
    proc, url, log = start(tmp_path, 120)
    try:
        body = {"prompt": "Tell me a story.", "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            events = (line for line in r.iter_lines() if line.startswith("data:"))
            next(events)
            proc.send_signal(signal.SIGTERM)
            time.sleep(1.0)
            assert proc.poll() is None   # draining: the stream still runs
            proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            assert proc.wait(timeout=10) == 128 + signal.SIGTERM
            assert time.monotonic() - sent < 5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.seek(0)
        output = log.read()
        log.close()
    assert "SIGTERM during the graceful shutdown: exiting now" in output
