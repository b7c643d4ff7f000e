"""`conveyor serve` as a real process (one engine, and two data-parallel replicas), shut down as
docs/server.md's table says: the first SIGTERM drains (requests in flight finish, new ones get a
503 in OpenAI's error shape) and a clean drain exits 0; a second SIGTERM aborts what is in flight:
every stream ends with an error event and [DONE], a non-streaming request gets a 503, exit 75.

Helpers here are shared with the other entry points' shutdown tests (run-batch, Ray)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from conftest import free_port, scrape_metrics, wait_healthy

pytestmark = pytest.mark.slow

EXIT_CUT_SHORT = 75
# Far longer than any test waits (the server's KV cache holds three of them: --num-kv-blocks 800).
LONG = {"prompt": "Tell me a story.", "max_tokens": 4000, "ignore_eos": True}
STARTUP_S = 600   # a start, not a speed: generous on a busy machine
EXIT_S = 60       # from the last signal to the process's exit: generous, yet far below the drain's timeout
DRAIN_S = 600     # --shutdown-timeout: a drain that is not cut would outlast every bound here


@dataclass
class Served:
    proc: subprocess.Popen
    url: str
    log: Path
    output: str = ""   # the server's log, once it has stopped

    def wait_for_log(self, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log.read_text():
            assert time.monotonic() < deadline, f"{text!r} not logged"
            time.sleep(0.1)


@contextlib.contextmanager
def serve(tmp_path, shutdown_timeout: float, *extra: str) -> Iterator[Served]:
    """`conveyor serve` on a free port, up and healthy; killed on exit if still running."""
    port = free_port()
    path = tmp_path / "serve.log"
    with open(path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "conveyor", "serve", "--port", str(port), "--num-kv-blocks", "800",
             "--max-num-seqs", "4", "--shutdown-timeout", str(shutdown_timeout), "--log-interval", "1", *extra],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    served = Served(proc, f"http://127.0.0.1:{port}", path)
    try:
        wait_healthy(proc, served.url, path, STARTUP_S)
        yield served
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        served.output = path.read_text()


@dataclass
class Stream:
    """One streaming completion read on a thread: its `data:` lines, `started` at the first token."""

    url: str
    body: dict
    lines: list[str] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json={**self.body, "stream": True},
                              timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        self.lines.append(line)
                        self.started.set()
        except BaseException as e:   # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.started.set()

    def ended(self, timeout: float = EXIT_S) -> list[str]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream did not end"
        assert self.error is None, f"the stream was cut: {self.error!r} after {self.lines[-2:]}"
        return self.lines


@dataclass
class Plain:
    """One non-streaming completion on a thread."""

    url: str
    body: dict
    response: httpx.Response | None = None

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._send, daemon=True)
        self.thread.start()

    def _send(self) -> None:
        self.response = httpx.post(f"{self.url}/v1/completions", json=self.body, timeout=120)

    def answer(self, timeout: float = EXIT_S) -> httpx.Response:
        self.thread.join(timeout)
        assert self.response is not None, "no answer"
        return self.response


def wait_in_flight(url: str, n: int, timeout: float = 120) -> None:
    """Until the engine holds `n` requests (running or waiting)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=url, timeout=10) as http:
        while True:
            m = scrape_metrics(http)
            if m["conveyor:num_requests_running"] + m["conveyor:num_requests_waiting"] >= n:
                return
            assert time.monotonic() < deadline, f"fewer than {n} requests in flight: {m}"
            time.sleep(0.1)


def assert_unavailable(r: httpx.Response) -> None:
    """A 503 in OpenAI's error shape, saying the server is shutting down."""
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "unavailable" and "shutting down" in error["message"]


def assert_ended_with_error(lines: list[str]) -> None:
    """A stream cut by the shutdown: an error event (OpenAI's shape) then [DONE]."""
    assert lines[-1] == "data: [DONE]", lines[-3:]
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "unavailable" and "shutting down" in error["message"], error


def assert_finished(lines: list[str], reason: str) -> None:
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == reason, lines[-2]


def exit_code(proc: subprocess.Popen, since: float) -> int:
    code = proc.wait(timeout=EXIT_S)
    assert time.monotonic() - since < EXIT_S
    return code


def test_first_signal_drains_in_flight_requests_and_exits_0(tmp_path):
    with serve(tmp_path, DRAIN_S) as s:
        stream = Stream(s.url, {"prompt": "Tell me a story.", "max_tokens": 100, "ignore_eos": True})
        assert stream.started.wait(120)
        s.proc.send_signal(signal.SIGTERM)
        # While it drains, the server still answers: new work gets a 503, /health says it is going away.
        assert_unavailable(httpx.post(f"{s.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30))
        assert httpx.get(f"{s.url}/health", timeout=30).status_code == 503
        assert_finished(stream.ended(120), "length")   # the request in flight ran to its end
        assert exit_code(s.proc, time.monotonic()) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{s.url}/health", timeout=2)
    assert "drained: every request in flight finished" in s.output
    assert "Application startup complete" in s.output and "Traceback" not in s.output


@pytest.mark.parametrize("replicas", [1, 2], ids=["one-engine", "data-parallel-2"])
def test_second_signal_ends_every_request_in_flight_with_an_error(tmp_path, replicas):
    """Streams and a non-streaming request in flight; SIGTERM, then SIGTERM again 0.5 s later."""
    with serve(tmp_path, DRAIN_S, "--data-parallel-size", str(replicas)) as s:
        plain = Plain(s.url, LONG)
        streams = [Stream(s.url, LONG) for _ in range(2)]
        assert all(st.started.wait(120) for st in streams)
        wait_in_flight(s.url, 3)
        s.wait_for_log("tok/s")   # the periodic stats line (--log-interval 1), while busy
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert s.proc.poll() is None   # draining
        s.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        for st in streams:
            assert_ended_with_error(st.ended())
        assert_unavailable(plain.answer())
        assert exit_code(s.proc, sent) == EXIT_CUT_SHORT
    assert "SIGTERM during the drain: aborting the requests in flight" in s.output
    assert "drain cut short" in s.output and "Traceback" not in s.output
