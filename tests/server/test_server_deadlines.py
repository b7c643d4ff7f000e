"""Over real HTTP: a request that waited past its max_queue_time before its first scheduling is a 503
with the code "queue_timeout" (an error event when streaming), the request holding the slot is served,
/metrics counts the timeouts; a corrupt KV cache found on the transition to idle is counted in /metrics
and the server goes on serving."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import start_server

pytestmark = pytest.mark.slow


class Gate:
    """The engine's executor; while closed, execute() blocks (its step holds the engine loop)."""

    def __init__(self, runner):
        self.runner = runner
        self.entered = threading.Event()
        self.open = threading.Event()
        self.open.set()

    def swap(self, swap_out, swap_in) -> None:
        self.runner.swap(swap_out, swap_in)

    def execute(self, plan):
        self.entered.set()
        assert self.open.wait(60)
        return self.runner.execute(plan)


@pytest.fixture(scope="module")
def gated(demo_model):
    handle = start_server(demo_model, num_kv_blocks=64, max_num_seqs=1)
    gate = Gate(handle.engine.engine.runner)
    handle.engine.engine.core.executor = gate
    handle.engine.engine.core.idle_check_share = None   # the whole idle check on every transition
    yield handle, gate
    gate.open.set()
    handle.stop()


def test_a_request_past_its_queue_deadline_is_a_503(gated):
    handle, gate = gated
    handle.wait_idle()
    before = handle.metrics()
    url = handle.url
    gate.open.clear()
    gate.entered.clear()
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(httpx.post, f"{url}/v1/completions", timeout=120,
                            json={"prompt": "One two three", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
        assert gate.entered.wait(60)             # first runs its first step and holds the only slot
        late = pool.submit(httpx.post, f"{url}/v1/completions", timeout=120,
                           json={"prompt": "Red green", "max_tokens": 3, "max_queue_time": 0.05})

        def stream() -> list[str]:
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True,
                    "max_queue_time": 0.05}
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
                assert r.status_code == 200   # the stream had started: the error comes as an event
                return [line for line in r.iter_lines() if line]

        streamed = pool.submit(stream)
        deadline = time.monotonic() + 60
        while handle.engine.stats().num_unfinished_requests < 3:   # both queued behind first
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.1)                          # longer than their 0.05 s
        gate.open.set()
        r_first, r_late, events = first.result(), late.result(), streamed.result()
    assert r_first.status_code == 200 and r_first.json()["choices"][0]["finish_reason"] == "length"
    assert r_late.status_code == 503 and r_late.headers["Retry-After"]
    err = r_late.json()["error"]
    assert err["code"] == "queue_timeout" and err["type"] == "server_error"
    assert err["message"].startswith("queue timeout:") and "max_queue_time of 0.05 s" in err["message"]
    assert events[-1] == "data: [DONE]"
    error_event = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error_event["code"] == "queue_timeout"
    handle.wait_idle()
    after = handle.metrics()
    assert after["conveyor:request_queue_timeouts_total"] - before["conveyor:request_queue_timeouts_total"] == 2
    assert after["conveyor:kv_invariant_violations_total"] == 0


def test_max_queue_time_must_be_positive(gated):
    handle, _ = gated
    r = handle.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "max_queue_time": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_queue_time"


def test_a_corrupt_kv_cache_on_idle_is_counted_and_serving_goes_on(gated, caplog):
    handle, _ = gated
    handle.wait_idle()
    kv = handle.engine.engine.kv
    victim = next(reversed(kv.pool.free))      # a free block no small request reaches
    kv.pool.blocks[victim].ref_count += 1     # the engine thread is idle, waiting for work
    try:
        body = {"prompt": "Blue", "max_tokens": 2, "temperature": 0}
        assert handle.http.post("/v1/completions", json=body).status_code == 200
        handle.wait_idle()
        assert handle.metrics()["conveyor:kv_invariant_violations_total"] == 1
        assert "KV cache invariant violated" in caplog.text
    finally:
        kv.pool.blocks[victim].ref_count -= 1
    assert handle.http.post("/v1/completions", json=body).status_code == 200   # still serving
    handle.wait_idle()
    assert handle.metrics()["conveyor:kv_invariant_violations_total"] == 1
    assert handle.http.get("/health").status_code == 200
