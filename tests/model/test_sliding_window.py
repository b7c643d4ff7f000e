"""Sliding-window models through the whole engine: greedy tokens do not depend on the block size
(a window that starts mid-block), on preemption (swap and recompute) or on prefix-cache hits, and
equal transformers' generate. Tiny Gemma 3 (windowed layers around a global one) and a Mistral
with its window on every layer; windows of 8 tokens against prompts of 30-50, so every decode
step and most prefill chunks see a window.
"""

from __future__ import annotations

import pytest

from conveyor.engine.llm import LLM
from conveyor.sampling.params import SamplingParams

from model_testlib import random_prompts, with_tokenizer

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    shared = random_prompts([24], seed=11)[0]   # a common prefix: prefix-cache hits
    return [shared + tail for tail in random_prompts([6, 14, 26, 9, 20, 3], seed=12)]


def _run(path: str, **options) -> tuple[list[list[int]], object]:
    with LLM(path, dtype="float32", cost_model="none", **options) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.stats()


@pytest.mark.parametrize("name", ["gemma3", "mistral_swa"])
def test_windowed_outputs_do_not_depend_on_blocks_preemption_or_prefix_hits(tiny_models, name):
    family = tiny_models(name)
    assert family.cfg.sliding_window == 8
    path = with_tokenizer(family.path)
    want = [family.hf_greedy(p, GREEDY.max_tokens)[0] for p in _prompts()]
    plain, _ = _run(path, num_kv_blocks=256, block_size=16, enable_prefix_caching=False)
    assert plain == want
    for block_size in (1, 5):
        got, _ = _run(path, num_kv_blocks=2048 // block_size, block_size=block_size)
        assert got == want, f"block size {block_size}"
    for mode in ("swap", "recompute"):
        got, stats = _run(path, num_kv_blocks=14, block_size=8, preemption_mode=mode, admission_policy="optimistic",
                          max_num_seqs=6, long_prefill_token_threshold=16)
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, mode
        assert got == want, mode
