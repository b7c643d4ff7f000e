"""Bounded waiting (503 + Retry-After) and the API key, on a server with one sequence per step."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

BODY = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
AUTH = {"Authorization": "Bearer secret"}


def test_overload_burst(limited_server):
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=limited_server.url, timeout=120, headers=AUTH) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=BODY) for _ in range(10)))

    responses = asyncio.run(burst())
    ok = [r for r in responses if r.status_code == 200]
    rejected = [r for r in responses if r.status_code == 503]
    assert len(ok) + len(rejected) == 10, [r.status_code for r in responses]
    assert ok and rejected
    for r in rejected:
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "overloaded"
    for r in ok:
        assert r.json()["usage"]["completion_tokens"] == 4
    limited_server.wait_idle()
    after = limited_server.http.post("/v1/completions", json=BODY, headers=AUTH)
    assert after.status_code == 200


def test_api_key(limited_server):
    http = httpx.Client(base_url=limited_server.url, timeout=60)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "secret"}):
        r = http.post("/v1/completions", json=BODY, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/v1/models", headers=headers).status_code == 401
        assert http.post("/tokenize", json={"prompt": "x"}, headers=headers).status_code == 401
    assert http.get("/health").status_code == 200
    assert http.get("/metrics").status_code == 200
    assert http.post("/v1/completions", json=BODY, headers=AUTH).status_code == 200
    bad = openai.OpenAI(base_url=f"{limited_server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = limited_server.openai()
    assert good.models.list().data[0].id == limited_server.engine.model_name
    http.close()
