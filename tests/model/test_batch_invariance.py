"""Greedy output does not depend on batch composition, chunk size or block size.

Every run is compared with transformers' greedy tokens and with the logits of a reference run
(serial, chunk 64, block 16); same fp32 tolerance as test_model_vs_hf (see its docstring).
"""

from __future__ import annotations

import pytest
import torch

from model_testlib import assert_greedy_matches, conveyor_greedy, logit_atol, random_prompts

PROMPT_LENGTHS = [1, 6, 19, 47, 130]
MAX_NEW = 32
_baseline: dict[str, object] = {}


def _prompts():
    return random_prompts(PROMPT_LENGTHS, seed=11)


def _baseline_run(fam):
    if fam.name not in _baseline:
        _baseline[fam.name] = conveyor_greedy(fam.model, _prompts(), MAX_NEW, block_size=16, chunk=64, serial=True)
    return _baseline[fam.name]


def _check(fam, run, what):
    base = _baseline_run(fam)
    for i, prompt in enumerate(_prompts()):
        want, want_logits = fam.hf_greedy(prompt, MAX_NEW)
        assert_greedy_matches(run.tokens[i], want, run.logits[i], want_logits, f"{what} prompt {i}")
        torch.testing.assert_close(run.logits[i], base.logits[i], rtol=0, atol=logit_atol(base.logits[i]))


@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.parametrize("mode", ["batched", "serial"])
def test_invariant_to_batching_chunk_and_block_size(tiny_models, mode, chunk, block_size):
    fam = tiny_models("llama_gqa")
    run = conveyor_greedy(fam.model, _prompts(), MAX_NEW, block_size=block_size, chunk=chunk,
                          serial=mode == "serial", stagger=3, seed=chunk * 1000 + block_size)
    if mode == "batched":
        assert run.mixed_steps > 0   # prefill chunks and decodes really shared steps
    _check(fam, run, f"{mode} chunk={chunk} block={block_size}")


@pytest.mark.parametrize("name", ["llama3_rope", "qwen2", "qwen3", "mistral", "llama_tied"])
@pytest.mark.parametrize("chunk, block_size", [(1, 256), (7, 1)])
def test_other_families_batched(tiny_models, name, chunk, block_size):
    fam = tiny_models(name)
    run = conveyor_greedy(fam.model, _prompts(), MAX_NEW, block_size=block_size, chunk=chunk, stagger=5, seed=7)
    assert run.mixed_steps > 0
    _check(fam, run, f"{name} chunk={chunk} block={block_size}")


def test_all_start_together(tiny_models):
    """No stagger: every sequence prefills in the first steps, then all decode together."""
    fam = tiny_models("qwen3")
    _check(fam, conveyor_greedy(fam.model, _prompts(), MAX_NEW, block_size=16, chunk=7, stagger=0), "together")


def test_long_context_over_many_scattered_blocks(tiny_models):
    """One 300-token context in 332 single-token blocks in random order, batched with short ones."""
    fam = tiny_models("llama_gqa")
    prompts = random_prompts([300, 3, 30], seed=5)
    run = conveyor_greedy(fam.model, prompts, MAX_NEW, block_size=1, chunk=64, stagger=1, seed=3)
    for i, prompt in enumerate(prompts):
        want, want_logits = fam.hf_greedy(prompt, MAX_NEW)
        assert_greedy_matches(run.tokens[i], want, run.logits[i], want_logits, f"long context prompt {i}")
        torch.testing.assert_close(run.logits[i], want_logits, rtol=0, atol=logit_atol(want_logits))
