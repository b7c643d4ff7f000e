"""vLLM's cache_salt over HTTP (official openai client, extra_body) and through the engine process:
prefix-cache hits (the /metrics counter) happen only between requests with the same salt."""

from __future__ import annotations

import asyncio
import uuid

import openai
import pytest

from conveyor.config import EngineConfig
from conveyor.transport.process import ProcessEngine
from conveyor.sampling.params import SamplingParams

PROMPT = "Salted prompts share cached blocks only with the same salt, so one tenant cannot probe another. " * 3


def hits(server) -> float:
    server.wait_idle()
    return server.metrics()["conveyor:prefix_cache_hits_total"]


def test_completions_hit_the_cache_only_within_a_salt(server, client, model_name):
    blocks = (len(server.http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]) - 1) // 16
    assert blocks >= 2
    salt, other = f"a-{uuid.uuid4().hex}", f"b-{uuid.uuid4().hex}"

    def complete(salt: str | None) -> float:
        before = hits(server)
        extra = {"cache_salt": salt} if salt is not None else None
        r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=1, temperature=0, extra_body=extra)
        assert r.choices[0].text is not None
        return hits(server) - before

    assert complete(salt) == 0          # a new salt: nothing is cached under it
    assert complete(other) == 0         # the same prompt under another salt is not shared
    assert complete(salt) == blocks     # the same salt: every full prompt block but the last token's
    # chat carries it too: the first call caches the rendered prompt under the salt, the second hits it
    messages = [{"role": "user", "content": PROMPT}]
    before = hits(server)
    for _ in range(2):
        client.chat.completions.create(model=model_name, messages=messages, max_tokens=1, temperature=0,
                                       extra_body={"cache_salt": salt})
    assert hits(server) - before > 0
    before = hits(server)
    client.chat.completions.create(model=model_name, messages=messages, max_tokens=1, temperature=0,
                                   extra_body={"cache_salt": other + "-chat"})
    assert hits(server) - before == 0
    # and the Responses API
    before = hits(server)
    for _ in range(2):
        client.responses.create(model=model_name, input=PROMPT, max_output_tokens=1,
                                extra_body={"cache_salt": other + "-responses"})
    assert hits(server) - before > 0
    # one layer group (no sliding-window layers): its hits, as /metrics reports them per group, are the hits
    m = server.metrics()
    assert m["conveyor:prefix_cache_group_hits_total{group=0,window=0}"] == m["conveyor:prefix_cache_hits_total"] > 0


@pytest.mark.parametrize("salt", ["", 5])
def test_bad_salt_is_a_400(client, model_name, salt):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt="Hi", max_tokens=1, extra_body={"cache_salt": salt})
    assert e.value.body["param"] == "cache_salt"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                       extra_body={"cache_salt": salt})


@pytest.mark.slow
def test_salt_crosses_the_process_boundary():
    engine = ProcessEngine(EngineConfig.from_options(dtype="float32", num_kv_blocks=64, cost_model="none"))
    ids = list(range(100, 150))   # 3 full blocks of 16 before the last token
    params = SamplingParams(max_tokens=1, temperature=0)

    async def run(i: int, salt: str) -> int:
        before = engine.stats().prefix_cache_hits
        async for _ in engine.add_request({"prompt_token_ids": ids, "cache_salt": salt}, params, f"r{i}"):
            pass
        return engine.stats().prefix_cache_hits - before

    async def main() -> list[int]:
        return [await run(i, s) for i, s in enumerate(["a", "b", "a"])]

    try:
        assert asyncio.run(main()) == [0, 0, 3]
    finally:
        engine.close(timeout=10)
