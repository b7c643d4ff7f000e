"""The drain every entry point shares (conveyor/server/shutdown.py), in-process: a drain that finishes
what is in flight is not cut short; one that reaches its timeout aborts the rest (a stream ends with
an error event and [DONE]) and says so; signals received before anyone listens are not lost."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest

from conftest import start_server
from conveyor.server.shutdown import SIGNALS, Drain, Signals

pytestmark = pytest.mark.slow


def stream_lines(url: str, body: dict, started: threading.Event, lines: list[str]) -> None:
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                lines.append(line)
                started.set()


def drain_while_streaming(demo_model, body: dict, timeout: float) -> tuple[bool, float, list[str]]:
    """(cut short, seconds the drain took, the stream's data lines) for a drain started at the stream's first token."""
    handle = start_server(demo_model)
    try:
        started, lines = threading.Event(), []
        reader = threading.Thread(target=stream_lines, args=(handle.url, body, started, lines))
        reader.start()
        assert started.wait(120)
        t0 = time.monotonic()
        cut_short = asyncio.run(Drain(handle.engine, timeout).wait())
        took = time.monotonic() - t0
        reader.join(60)
        assert not reader.is_alive()
        return cut_short, took, lines
    finally:
        handle.stop()


def test_a_drain_that_finishes_what_is_in_flight_is_not_cut_short(demo_model):
    cut_short, _, lines = drain_while_streaming(demo_model, {"prompt": "Hi", "max_tokens": 24, "ignore_eos": True},
                                                timeout=600)
    assert not cut_short
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"


def test_a_drain_at_its_timeout_aborts_the_rest(demo_model):
    body = {"prompt": "Tell me a story.", "max_tokens": 3000, "ignore_eos": True}
    cut_short, took, lines = drain_while_streaming(demo_model, body, timeout=1.0)
    assert cut_short and 1.0 <= took < 60
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "unavailable" and "shutting down" in error["message"]


def test_signals_before_anyone_listens_are_handed_over_in_order():
    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    try:
        signals = Signals.install()
        signal.raise_signal(signal.SIGTERM)   # nobody listening yet (a model still loading, say)
        seen: list[tuple[int, int]] = []
        signals.attach(lambda sig, count: seen.append((sig, count)))
        signal.raise_signal(signal.SIGINT)
        assert seen == [(signal.SIGTERM, 1), (signal.SIGINT, 2)]
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
