"""Soak: a thousand mixed requests against the real server with a small KV pool — streams and not,
chat, n > 1, stop strings, clients that disconnect, bad inputs, more load than the queue takes.

Afterwards nothing is left running, waiting or swapped, every KV block is free, no request got a
5xx other than the intended 503 (queue full), and greedy answers are the same as before.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter

import httpx
import pytest

from conftest import start_server

pytestmark = pytest.mark.slow

NUM_REQUESTS = 1000
CONCURRENCY = 24
WORDS = "the a cat dog runs fast slow red blue story about time river stone".split()
PROBE = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))


def _bad(rng: random.Random) -> tuple[str, bytes | dict]:
    kind = rng.randrange(7)
    if kind == 0:
        return "/v1/completions", json.dumps({"prompt": "ab\ud800cd", "max_tokens": 3}).encode()
    if kind == 1:
        return "/v1/completions", b'{"prompt": "unterminated'
    if kind == 2:
        return "/v1/completions", {"prompt": "x", "temperature": -1}
    if kind == 3:
        return "/v1/completions", {"prompt": "word " * 3000, "max_tokens": 3}     # longer than the context
    if kind == 4:
        return "/v1/chat/completions", {"messages": [], "max_tokens": 3}
    if kind == 5:
        return "/v1/completions", {"prompt": "x", "model": "no-such-model"}
    return "/v1/completions", {"prompt": "x", "stop": ["s"] * 100}


async def _one(http: httpx.AsyncClient, rng: random.Random, statuses: Counter) -> None:
    roll = rng.random()
    body = {"prompt": _prompt(rng), "max_tokens": rng.randint(1, 12), "temperature": rng.choice([0, 0.8]),
            "seed": rng.randrange(1000)}
    if roll < 0.15:   # bad input
        path, payload = _bad(rng)
        kw = {"content": payload, "headers": {"Content-Type": "application/json"}} if isinstance(payload, bytes) \
            else {"json": payload}
        r = await http.post(path, **kw)
        statuses[r.status_code] += 1
        assert 400 <= r.status_code < 500 or r.status_code == 503, (r.status_code, r.text)
        return
    if roll < 0.30:   # a client that goes away mid-stream
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True, "max_tokens": 40}) as r:
            statuses[r.status_code] += 1
            async for line in r.aiter_lines():
                if line.startswith("data:") and rng.random() < 0.5:
                    break
        return
    if roll < 0.38:   # a client that gives up before the full response
        try:
            r = await asyncio.wait_for(http.post("/v1/completions", json={**body, "max_tokens": 60}),
                                       timeout=rng.uniform(0.05, 1.0))
            statuses[r.status_code] += 1
        except asyncio.TimeoutError:
            statuses["gave up"] += 1
        return
    if roll < 0.50:
        chat = {"messages": [{"role": "user", "content": body.pop("prompt")}], **body,
                "stream": rng.random() < 0.5}
        if chat["stream"]:
            async with http.stream("POST", "/v1/chat/completions", json=chat) as r:
                statuses[r.status_code] += 1
                lines = [line async for line in r.aiter_lines() if line.startswith("data:")]
                assert r.status_code != 200 or lines[-1] == "data: [DONE]"
                assert not any('"error"' in line for line in lines), lines
            return
        r = await http.post("/v1/chat/completions", json=chat)
    elif roll < 0.60:
        r = await http.post("/v1/completions", json={**body, "n": 2, "logprobs": 2, "stop": [rng.choice(WORDS)]})
    else:
        r = await http.post("/v1/completions", json=body)
    statuses[r.status_code] += 1
    assert r.status_code in (200, 503), (r.status_code, r.text)


async def _soak(url: str, seed: int) -> Counter:
    rng = random.Random(seed)
    statuses: Counter = Counter()
    sem = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        async def guarded(i: int) -> None:
            async with sem:
                before = statuses[503]
                await _one(http, random.Random(rng.random() + i), statuses)
                if statuses[503] > before:   # as a client honouring Retry-After would, back off a little
                    await asyncio.sleep(0.5)

        await asyncio.gather(*(guarded(i) for i in range(NUM_REQUESTS)))
    return statuses


def test_soak(demo_model):
    # 24 blocks of 16 tokens for up to 16 sequences: preemption (swap and recompute, by cost), and a
    # queue of 12 sequences beyond which requests get 503.
    server = start_server(demo_model, num_kv_blocks=24, max_num_seqs=16, max_waiting=12,
                          engine_options=dict(preemption_mode="auto", admission_policy="optimistic",
                                              swap_space_gib=0.01))
    engine = server.engine.engine
    try:
        before = server.http.post("/v1/completions", json=PROBE).json()["choices"][0]["text"]
        statuses = asyncio.run(_soak(server.url, seed=0))
        print("statuses:", dict(statuses), "stats:", server.engine.stats())
        assert sum(statuses.values()) == NUM_REQUESTS
        # How many get 503 (queue full) depends on how fast this machine serves: 486-520 of 1,000
        # were 200 in runs on 2 cores; a third is the floor that says the server kept serving.
        assert statuses[200] > NUM_REQUESTS // 3 and statuses[400] > 50 and statuses[503] > 0
        assert not [s for s in statuses if isinstance(s, int) and s >= 500 and s != 503]
        s = server.wait_idle(60)
        m = server.metrics()
        assert m["conveyor:num_requests_running"] == m["conveyor:num_requests_waiting"] == 0
        assert m["conveyor:num_requests_swapped"] == 0 and m["conveyor:kv_cache_usage_perc"] == 0.0
        assert s["num_free_kv_blocks"] == s["num_kv_blocks"] and s["num_aborted"] > 0
        assert s["num_preemptions"] > 0 and s["step_failures"] == 0
        engine.kv.check_invariants(set())
        assert engine.kv.num_free_host_blocks == engine.kv.num_host_blocks
        after = server.http.post("/v1/completions", json=PROBE).json()["choices"][0]["text"]
        assert after == before
        assert server.http.get("/health").status_code == 200
    finally:
        server.stop()
