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
    """Greedy tokens of all prompts, after the first one ran alone (its blocks are cached: the
    others' shared prefix hits, in a local group only the blocks its window sees)."""
    with LLM(path, dtype="float32", cost_model="none", **options) as llm:
        prompts = [{"prompt_token_ids": p} for p in _prompts()]
        llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        stats = llm.stats()
        assert stats.kv_invariant_checks > 0 and stats.kv_invariant_violations == 0
        return [o.outputs[0].token_ids for o in outs], stats


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
    # A cache that holds about two of these sequences at once (a block holds one layer group's K/V:
    # Gemma's three layers form three groups, Mistral's one). Gemma's global layer grows, so requests
    # admitted optimistically preempt one another; Mistral's sequences never outgrow their window
    # (plus a prefill chunk), which admission counts exactly, so they run two by two without
    # preemption (windowed preemption: tests/scheduler/test_scheduler_props.py).
    tight = {"gemma3": 24, "mistral_swa": 8}[name]
    for mode in ("swap", "recompute"):
        got, stats = _run(path, num_kv_blocks=tight, block_size=8, preemption_mode=mode, admission_policy="optimistic",
                          max_num_seqs=6, long_prefill_token_threshold=16)
        assert stats.prefix_cache_hits > 0 and (stats.num_preemptions > 0) == (name == "gemma3"), mode
        assert got == want, mode


def test_local_layers_hold_only_their_window(tiny_models):
    """Mistral's window on every layer: a sequence holds a window's blocks, not its length's. A cache
    of 48 tokens serves a 50-token prompt plus 24 tokens (transformers' greedy tokens); with the
    hybrid KV cache off, the same cache cannot take the prompt."""
    family = tiny_models("mistral_swa")
    path = with_tokenizer(family.path)
    prompt = random_prompts([50], seed=5)[0]
    want = family.hf_greedy(prompt, GREEDY.max_tokens)[0]
    with LLM(path, dtype="float32", cost_model="none", num_kv_blocks=6, block_size=8) as llm:
        out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want
        stats = llm.stats()
        assert stats.kv_group_windows == (8,) and stats.kv_invariant_violations == 0
    with LLM(path, dtype="float32", cost_model="none", num_kv_blocks=6, block_size=8, hybrid_kv_cache=False) as llm:
        with pytest.raises(ValueError):
            llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)


def test_prefix_hits_are_reported_per_layer_group(tiny_models):
    """Gemma's global layer and its two local ones form three groups; each group's hits are
    counted, and a hit (all groups) is never more than any group could supply."""
    path = with_tokenizer(tiny_models("gemma3").path)
    _, stats = _run(path, num_kv_blocks=256, block_size=4)
    assert stats.kv_group_windows == (0, 8, 8)
    assert stats.prefix_cache_hits > 0
    assert all(h >= stats.prefix_cache_hits for h in stats.prefix_cache_group_hits)


def test_profile_runs_on_a_hybrid_kv_cache(tiny_models):
    """`conveyor profile`'s synthetic plans give each sequence one block per layer group and block of
    tokens, interleaved as the KV manager builds tables (Gemma 3: local and global groups); before,
    they gave one per block and the runner's slot mapping indexed past the table."""
    from conveyor.profile import profile

    family = tiny_models("gemma3")
    with LLM(with_tokenizer(family.path), dtype="float32", cost_model="none", max_num_seqs=8) as llm:
        layout = llm.engine.runner.layout
        assert layout is not None and layout.num_groups > 1
        model = profile(llm.engine, quick=True, repeats=1, progress=False)
    # real timings: the fit clips a knot at zero, and noise may put one there (benchmarks/profile_fit.py)
    assert model.knots and all(c >= 0 for c in model.knot_costs) and sum(model.knot_costs) > 0
    assert model.meta["fit"]["samples"] == len(model.meta["samples"]) > 0
