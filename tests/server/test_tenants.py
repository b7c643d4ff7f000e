"""Tenants over real HTTP: each API key is its own tenant; a flooding tenant does not starve a light one
(the scheduler's VTC order, one sequence per step so the order is the finish order); a tenant over
--tenant-max-requests gets 429 + Retry-After while others are served; per-tenant metrics on /metrics."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from conveyor.server.tenants import TENANT_HEADER
from conftest import start_server

pytestmark = pytest.mark.slow

BODY = {"prompt": "Count to ten:", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
HEAVY, LIGHT = {"Authorization": "Bearer heavy-key"}, {"Authorization": "Bearer light-key"}


@pytest.fixture(scope="module")
def tenant_server(demo_model):
    handle = start_server(demo_model, max_num_seqs=1, api_key="heavy-key,light-key", tenant_max_requests=9)
    yield handle
    handle.stop()


async def _finish_order(url: str, tenant_of_request: list[dict]) -> list[int]:
    """Send the requests one after the other, each once the server holds the one before (its stream
    headers came back); the indices in the order they finished."""
    order: list[int] = []
    async with httpx.AsyncClient(base_url=url, timeout=300) as http, contextlib.AsyncExitStack() as stack:
        async def read(i: int, response) -> None:
            async for _ in response.aiter_bytes():
                pass
            order.append(i)

        tasks = []
        for i, headers in enumerate(tenant_of_request):
            response = await stack.enter_async_context(
                http.stream("POST", "/v1/completions", json={**BODY, "stream": True}, headers=headers))
            assert response.status_code == 200
            tasks.append(asyncio.create_task(read(i, response)))
        await asyncio.gather(*tasks)
    return order


def test_a_flooding_key_does_not_starve_another(tenant_server):
    order = asyncio.run(_finish_order(tenant_server.url, [HEAVY] * 8 + [LIGHT]))
    # one sequence at a time, so requests finish in the order they were admitted: the light one comes in
    # as soon as the first heavy one is done (fcfs would put it last)
    assert order.index(8) <= 2, order
    tenant_server.wait_idle()
    m = tenant_server.metrics()
    heavy, light = "key-1", "key-2"   # by their place in --api-key
    assert m[f"conveyor:tenant_requests_total{{tenant={heavy}}}"] >= 8
    assert m[f"conveyor:tenant_requests_total{{tenant={light}}}"] >= 1
    assert m[f"conveyor:tenant_generation_tokens_total{{tenant={light}}}"] >= 6
    assert not any("heavy-key" in k or "light-key" in k for k in m)   # a key never shows


def test_a_tenant_over_its_cap_gets_429_and_others_do_not(demo_model):
    server = start_server(demo_model, max_num_seqs=1, tenant_max_requests=2)
    try:
        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as http, contextlib.AsyncExitStack() as st:
                streams = []
                for _ in range(2):   # tenant "a" (the fairness header) at its cap: two in flight
                    r = await st.enter_async_context(http.stream(
                        "POST", "/v1/completions", json={**BODY, "stream": True}, headers={TENANT_HEADER: "a"}))
                    assert r.status_code == 200
                    streams.append(r)
                over = await http.post("/v1/completions", json=BODY, headers={TENANT_HEADER: "a"})
                other = await http.post("/v1/completions", json={**BODY, "user": "b"})
                for r in streams:
                    async for _ in r.aiter_bytes():
                        pass
                return over, other

        over, other = asyncio.run(run())
        assert over.status_code == 429, over.text
        assert over.json()["error"]["code"] == "tenant_over_limit" and int(over.headers["Retry-After"]) >= 1
        assert other.status_code == 200 and other.json()["usage"]["completion_tokens"] == 6
        server.wait_idle()
        # everything finished (the aborted and the refused included): the tenant may send again
        again = server.http.post("/v1/completions", json=BODY, headers={TENANT_HEADER: "a"})
        assert again.status_code == 200
        m = server.metrics()
        assert m["conveyor:tenant_requests_rejected_total{tenant=a}"] == 1
        assert m["conveyor:tenant_requests_total{tenant=b}"] == 1
    finally:
        server.stop()


def test_a_disconnected_stream_gives_its_slot_back(demo_model):
    server = start_server(demo_model, max_num_seqs=1, tenant_max_requests=1)
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            with http.stream("POST", "/v1/completions", json={**BODY, "max_tokens": 200, "stream": True},
                             headers={TENANT_HEADER: "a"}) as r:
                assert r.status_code == 200
                next(r.iter_bytes())   # then the client goes away
            server.wait_idle()
            assert http.post("/v1/completions", json=BODY, headers={TENANT_HEADER: "a"}).status_code == 200
    finally:
        server.stop()
