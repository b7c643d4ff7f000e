"""Streams get immutable per-step deltas: with many concurrent streamed requests asking for logprobs,
readers slower than the engine (so a stream merges several steps' outputs) and the CPU busy beside
them, every logprob entry a chunk carries belongs to that chunk's token, and none is lost or repeated.

Before, a running output shared the output processor's growing token and logprob lists, and a stream
sliced them by their length at the time it read them, while the receiving thread kept appending."""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import random
import time

import httpx
import pytest

from conftest import start_server
from conveyor.transport.thread import AsyncEngine
from conveyor.engine.engine import Engine, EngineConfig
from conveyor.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

STREAMS = 24
TOKENS = 40


def _spin() -> None:
    while True:
        pass


@pytest.fixture(scope="module")
def busy_server(demo_model):
    handle = start_server(demo_model, max_num_seqs=STREAMS, num_kv_blocks=512)
    burners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(2)]
    for p in burners:
        p.start()
    yield handle
    for p in burners:
        p.terminate()
        p.join()
    handle.stop()


async def _read(http: httpx.AsyncClient, path: str, body: dict, rng: random.Random) -> list[dict]:
    chunks = []
    async with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks.append(json.loads(line[6:]))
            await asyncio.sleep(rng.uniform(0, 0.03))   # a slow reader: the engine runs ahead of it
    return chunks


def _check_completion(chunks: list[dict]) -> int:
    """Each chunk's logprobs: one per token, each entry the chunk's own token's. Returns the token count."""
    count = 0
    for ch in chunks:
        for choice in ch["choices"]:
            lp = choice["logprobs"]
            if lp is None:
                continue
            n = len(lp["tokens"])
            assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
            for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
                # the sampled token is always in its own entry (top-k plus itself), with the same logprob
                assert top is not None and token in top and top[token] == logprob, (token, logprob, top)
            count += n
    return count


def _check_chat(chunks: list[dict]) -> int:
    count = 0
    for ch in chunks:
        for choice in ch["choices"]:
            lp = choice.get("logprobs")
            if not lp or not lp.get("content"):
                continue
            for item in lp["content"]:
                # an entry taken from another position lacks this token: its logprob would read -inf
                assert math.isfinite(item["logprob"]), item
                top = {t["token"]: t["logprob"] for t in item["top_logprobs"]}
                assert len(top) == 3 and (item["token"] not in top or top[item["token"]] == item["logprob"])
            count += len(lp["content"])
    return count


def test_concurrent_slow_streams_get_each_tokens_own_logprobs(busy_server):
    model = busy_server.engine.model_name

    async def main():
        rng = random.Random(7)
        async with httpx.AsyncClient(base_url=busy_server.url, timeout=600) as http:
            jobs = []
            for i in range(STREAMS):
                common = {"model": model, "max_tokens": TOKENS, "temperature": 1.0, "seed": i, "stream": True,
                          "ignore_eos": True, "stream_options": {"include_usage": True}}
                if i % 2:
                    body = {**common, "messages": [{"role": "user", "content": f"Story {i}, go."}],
                            "logprobs": True, "top_logprobs": 3}
                    jobs.append(("chat", _read(http, "/v1/chat/completions", body, random.Random(rng.random()))))
                else:
                    body = {**common, "prompt": f"Story number {i}:", "logprobs": 2}
                    jobs.append(("completion", _read(http, "/v1/completions", body, random.Random(rng.random()))))
            results = await asyncio.gather(*(job for _, job in jobs))
            return [(kind, chunks) for (kind, _), chunks in zip(jobs, results)]

    for kind, chunks in asyncio.run(main()):
        counted = _check_chat(chunks) if kind == "chat" else _check_completion(chunks)
        usage = chunks[-1]["usage"]
        assert counted == usage["completion_tokens"] == TOKENS, kind   # none lost, none repeated
    stats = busy_server.wait_idle()
    assert stats.num_kv_blocks == stats.num_free_kv_blocks


def test_a_running_output_never_changes_after_it_is_handed_over(demo_model):
    """A consumer that holds the event loop (here: time.sleep in it) while the engine thread runs more
    steps finds each output as it was handed over: its deltas are its own tuples, a running output carries
    no cumulative token list that the next step could extend, and the deltas add up to the final output."""
    engine = AsyncEngine(Engine(EngineConfig(num_kv_blocks=256, block_size=16), loaded=demo_model))
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=24, logprobs=2, ignore_eos=True) for i in range(6)]

    async def consume(i: int) -> tuple[list, list, object]:
        ids, entries, final = [], [], None
        async for out in engine.add_request(f"Tell me about {i}", params[i], f"r{i}"):
            (c,) = out.outputs
            seen = (c.text, tuple(c.delta_token_ids), c.delta_logprobs, c.token_ids)
            time.sleep(0.02)   # the engine thread steps on meanwhile; the output must stay as it was
            assert (c.text, tuple(c.delta_token_ids), c.delta_logprobs, c.token_ids) == seen
            assert isinstance(c.delta_token_ids, tuple) and isinstance(c.delta_logprobs, tuple)
            assert len(c.delta_logprobs) == len(c.delta_token_ids)
            assert all(t in e for t, e in zip(c.delta_token_ids, c.delta_logprobs))   # each entry its token's
            assert c.token_ids is None if not c.finished else len(c.token_ids) == len(ids) + len(c.delta_token_ids)
            ids += c.delta_token_ids
            entries += c.delta_logprobs
            final = c
        return ids, entries, final

    async def main():
        return await asyncio.gather(*(consume(i) for i in range(len(params))))

    try:
        for ids, entries, final in asyncio.run(main()):
            assert ids == final.token_ids and len(ids) == 24 and entries == final.logprobs
    finally:
        engine.close()
