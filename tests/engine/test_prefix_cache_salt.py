"""cache_salt through the offline engine: a dict prompt's salt reaches the scheduler's requests,
prefix-cache hits happen only within a salt, and the outputs do not depend on it."""

from __future__ import annotations

import pytest

from conveyor.engine.engine import InvalidRequestError
from conveyor.sampling.params import SamplingParams

PROMPT = [(7 * i + 3) % 200 + 1 for i in range(70)]   # 4 full blocks of 16 (and 6 tokens)


def run(engine, prompt: dict) -> tuple[list[int], int]:
    """Greedy tokens of one request, and the prefix-cache hits (blocks) its admission found."""
    before = engine.stats().prefix_cache_hits
    rid = engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                tokens = list(out.outputs[0].token_ids)
    return tokens, engine.stats().prefix_cache_hits - before


def test_hits_only_within_a_salt(make_engine):
    engine = make_engine()
    base, hits = run(engine, {"prompt_token_ids": PROMPT, "cache_salt": "tenant-a"})
    assert hits == 0
    assert run(engine, {"prompt_token_ids": PROMPT, "cache_salt": "tenant-b"}) == (base, 0)
    assert run(engine, {"prompt_token_ids": PROMPT}) == (base, 0)
    assert run(engine, {"prompt_token_ids": PROMPT, "cache_salt": "tenant-a"}) == (base, 4)
    assert run(engine, {"prompt_token_ids": PROMPT}) == (base, 4)   # the unsalted run above is cached too


def test_salt_reaches_every_sequence(make_engine, monkeypatch):
    engine = make_engine()
    seqs = []
    add = engine.core.add_request
    monkeypatch.setattr(engine.core, "add_request", lambda seq: (seqs.append(seq), add(seq)))
    engine.add_request({"prompt_token_ids": PROMPT, "cache_salt": "s"}, SamplingParams(max_tokens=2, n=2))
    engine.add_request({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2))
    assert [s.cache_salt for s in seqs] == ["s", "s", None]
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("salt", ["", 5, b"x"])
def test_bad_salt_is_rejected(make_engine, salt):
    engine = make_engine()
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        engine.inputs.process({"prompt_token_ids": PROMPT, "cache_salt": salt})
