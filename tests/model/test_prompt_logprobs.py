"""Prompt logprobs equal transformers' log-softmax over a full forward of the prompt, however the
prompt is chunked or read from cached blocks that kept the entries; with prompt_logprobs_last
only the tail has entries, the rest read from the cache; a request keeps exactly one entry per
prompt token through preemption."""

from __future__ import annotations

import pytest
import torch

from conveyor.engine.llm import LLM
from conveyor.sampling.params import SamplingParams

from model_testlib import random_prompts, with_tokenizer

pytestmark = pytest.mark.slow


def hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("name", ["llama_gqa", "qwen3"])
@pytest.mark.parametrize("budget", [16, 1024])   # many chunks, or one
def test_prompt_logprobs_match_transformers(tiny_models, name, budget):
    fam = tiny_models(name)
    prompts = random_prompts([37, 5, 64], seed=2)
    llm = LLM(with_tokenizer(fam.path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=budget,
              long_prefill_token_threshold=budget, cost_model="none")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref = hf_prompt_logprobs(fam.hf, prompt)
        entries = out.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        for j in range(1, len(prompt)):
            entry, want = entries[j], ref[j - 1]
            assert abs(entry[prompt[j]] - want[prompt[j]].item()) < 1e-4
            top = sorted(entry, key=entry.get, reverse=True)[:3]
            assert set(top) == set(want.topk(3).indices.tolist())   # the target, if outside, ranks below


def test_no_prefix_cache_reads_and_preemption_keeps_one_entry_per_token(tiny_models):
    fam = tiny_models("llama_gqa")
    shared = random_prompts([48], seed=4)[0]
    prompts = [shared + [i] for i in range(6)]
    path = with_tokenizer(fam.path)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=1)
    roomy = LLM(path, dtype="float32", num_kv_blocks=128, cost_model="none")
    want = roomy.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert roomy.stats().prefix_cache_hits == 0   # the shared 48 tokens were computed for each
    roomy.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert roomy.stats().prefix_cache_hits > 0    # ...and published for requests that do not need them
    tight = LLM(path, dtype="float32", num_kv_blocks=16, block_size=8, preemption_mode="recompute",
                admission_policy="optimistic", min_resident_steps=1, cost_model="none")
    got = tight.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert tight.stats().num_recomputes > 0
    for a, b in zip(want, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(b.prompt_logprobs) == len(b.prompt_token_ids)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys() and max(abs(x[k] - y[k]) for k in x) < 1e-4


@pytest.mark.parametrize("block_size", [8, 16])
def test_last_prompt_logprobs_read_the_prefix_cache(tiny_models, block_size):
    """prompt_logprobs_last=n: only the last n tokens get entries (equal to transformers'), and the
    positions before the one predicting the first of them come from the prefix cache."""
    fam = tiny_models("llama_gqa")
    doc = random_prompts([45], seed=5)[0]
    queries = random_prompts([3, 9, 1, 17], seed=6)
    llm = LLM(with_tokenizer(fam.path), dtype="float32", num_kv_blocks=64, block_size=block_size,
              cost_model="none")
    for i, q in enumerate(queries):   # one at a time: the first publishes the document for the others
        prompt = doc + q
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2, prompt_logprobs_last=len(q))
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        cached = min(len(prompt) - len(q) - 1, len(prompt) - 1) // block_size * block_size
        assert llm.stats().prefix_cache_hits == i * cached // block_size
        ref = hf_prompt_logprobs(fam.hf, prompt)
        entries = out.prompt_logprobs
        assert len(entries) == len(prompt) and all(e is None for e in entries[:len(doc)])
        for j in range(len(doc), len(prompt)):
            assert abs(entries[j][prompt[j]] - ref[j - 1][prompt[j]].item()) < 1e-4


@pytest.mark.parametrize("block_size", [8, 16])
def test_prompt_logprobs_are_kept_with_cached_blocks(tiny_models, block_size):
    """A request that wants every prompt logprob reads the cached blocks that a request asking for the
    same top-k computed (their entries kept with them), recomputing only from the block before the
    first entry none keeps; another top-k reads nothing; every entry equals transformers'."""
    fam = tiny_models("llama_gqa")
    shared = random_prompts([45], seed=7)[0]
    tails = random_prompts([3, 9, 20], seed=8)
    llm = LLM(with_tokenizer(fam.path), dtype="float32", num_kv_blocks=64, block_size=block_size,
              cost_model="none")

    def run(prompt, k):
        before = llm.stats().prefix_cache_hits
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0,
                           prompt_logprobs=k), use_tqdm=False)[0]
        ref = hf_prompt_logprobs(fam.hf, prompt)
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for j in range(1, len(prompt)):
            entry = out.prompt_logprobs[j]
            assert abs(entry[prompt[j]] - ref[j - 1][prompt[j]].item()) < 1e-4
            assert set(sorted(entry, key=entry.get, reverse=True)[:k]) == set(ref[j - 1].topk(k).indices.tolist())
        return llm.stats().prefix_cache_hits - before

    assert run(shared + tails[0], 2) == 0
    full = len(shared) // block_size      # the shared prompt's whole blocks keep their entries...
    assert run(shared + tails[1], 2) == full - 1   # ...and the last is recomputed for the next entry's logits
    assert run(shared + tails[2], 3) == 0          # another top-k: nothing kept for it
    assert run(shared + tails[2], 2) == full - 1   # (blocks computed under k=3 keep nothing for k=2)
