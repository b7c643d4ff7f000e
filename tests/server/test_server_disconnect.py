"""A client that goes away aborts its request: the KV blocks free at once."""

from __future__ import annotations

import time

import httpx
import pytest

pytestmark = pytest.mark.slow

LONG = {"prompt": "Tell me a very long story.", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}


def _wait_for(server, predicate, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if predicate(m):
            return m
        assert time.monotonic() < deadline, f"timed out; metrics: {m}"
        time.sleep(0.05)


def test_disconnect_mid_stream_aborts(server):
    server.wait_idle()
    aborted = server.engine.stats().num_aborted
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [line for line, _ in zip((x for x in lines if x.startswith("data:")), range(3))]
            assert len(got) == 3
            assert server.metrics()["conveyor:kv_cache_usage_perc"] > 0
    # The client is gone long before 2000 tokens; the abort frees every block.
    m = _wait_for(server, lambda m: m["conveyor:num_requests_running"] == 0
                  and m["conveyor:kv_cache_usage_perc"] == 0.0)
    assert m["conveyor:num_requests_waiting"] == 0
    assert server.engine.stats().num_aborted == aborted + 1


def test_disconnect_while_waiting_for_full_response_aborts(server):
    server.wait_idle()
    aborted = server.engine.stats().num_aborted
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(60, read=1.0)) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                    "max_tokens": 2000, "ignore_eos": True})
    _wait_for(server, lambda m: m["conveyor:num_requests_running"] == 0 and m["conveyor:kv_cache_usage_perc"] == 0.0)
    assert server.engine.stats().num_aborted == aborted + 1
    assert server.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
