"""Many concurrent streaming clients against one server: all finish, each equals its lone greedy run."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The best way to learn is",
           "Water boils at", "My favourite animal is", "In 1492,", "The meaning of life is"]
CLIENTS = 32
MAX_TOKENS = 12


def test_concurrent_streaming_clients(server, client, model_name):
    # Sequential references first, each request alone in the engine.
    expected = {p: client.completions.create(model=model_name, prompt=p, max_tokens=MAX_TOKENS,
                                             temperature=0).choices[0].text for p in PROMPTS}

    async def one(aclient, prompt: str) -> tuple[str, str | None]:
        stream = await aclient.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS,
                                                  temperature=0, stream=True)
        text, reason = [], None
        async for chunk in stream:
            text.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
        return "".join(text), reason

    async def main() -> list[tuple[str, str | None]]:
        async with server.async_openai() as aclient:
            return await asyncio.gather(*(one(aclient, PROMPTS[i % len(PROMPTS)]) for i in range(CLIENTS)))

    results = asyncio.run(main())
    assert len(results) == CLIENTS
    for i, (text, reason) in enumerate(results):
        assert reason in ("stop", "length")
        assert text == expected[PROMPTS[i % len(PROMPTS)]], f"client {i}"
    stats = server.wait_idle()
    assert stats.kv_usage == 0.0
