"""Tensor parallelism over gloo: TP=2 gives TP=1's greedy tokens and logprobs on every tiny family
and on the demo model (uneven 6+3 head split), with preemption and prefix caching too; a rank
that dies fails requests with a clear error instead of hanging.
"""

from __future__ import annotations

import pytest

from conveyor.engine.llm import LLM
from conveyor.model.config import ModelConfig
from conveyor.parallel.tp import Shard, head_ranges, split
from conveyor.sampling.params import SamplingParams

from model_testlib import FAMILIES, random_prompts, with_tokenizer

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)


@pytest.mark.parametrize("nq,nkv,world", [(9, 3, 2), (8, 8, 3), (4, 1, 2), (4, 2, 4), (32, 8, 4), (6, 2, 2)])
def test_every_head_lands_on_exactly_one_rank(nq, nkv, world):
    owners = {}
    group = nq // nkv
    for rank in range(world):
        (q0, q1), (k0, k1) = head_ranges(nq, nkv, world, rank)
        assert q1 > q0 and k1 > k0
        for q in range(q0, q1):
            assert q not in owners
            owners[q] = rank
            assert k0 <= q // group < k1          # a rank's q heads read only its own kv heads
        assert (q1 - q0) % (k1 - k0) == 0          # uniform GQA groups inside a rank
    assert sorted(owners) == list(range(nq))


def test_splits_that_cannot_work_are_refused():
    assert [split(10, 3, r) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(ValueError, match="cannot split"):
        head_ranges(4, 1, 3, 0)     # 1 KV head over 3 ranks: 4 q heads do not divide
    cfg = ModelConfig(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=4, max_position_embeddings=32)
    with pytest.raises(ValueError, match="exceeds"):
        Shard.of(cfg, 0, 4)
    shards = [Shard.of(cfg, r, 2) for r in range(2)]
    assert [s.vocab_shard for s in shards] == [5, 5] and shards[1].local_config(cfg).num_key_value_heads == 1


def run(model: str, tp: int, prompts, params=GREEDY, **options):
    with LLM(model, tensor_parallel_size=tp, dtype="float32", cost_model="none", **options) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return outs, llm.stats()


def assert_same(a, b, atol: float = 1e-4):
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs or [], y.outputs[0].logprobs or []):
            assert lx.keys() == ly.keys()
            assert max(abs(lx[k] - ly[k]) for k in lx) < atol


# TP splits heads: the families whose heads differ run by default (GQA, q/k/v bias, q/k norm and its
# head_dim, Gemma 3's layer groups); the others are heavy.
TP_HEAVY = {"llama3_rope", "llama_tied", "mistral", "mistral_swa"}


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.heavy) if n in TP_HEAVY else n
                                  for n in sorted(FAMILIES)])
def test_tp2_equals_tp1_on_each_family(tiny_models, name):
    path = with_tokenizer(tiny_models(name).path)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 17, 40], seed=3)]
    one, _ = run(path, 1, prompts, num_kv_blocks=64)
    two, _ = run(path, 2, prompts, num_kv_blocks=64)
    assert_same(one, two)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["swap", pytest.param("recompute", marks=pytest.mark.heavy)])
def test_demo_tp2_equals_tp1_under_preemption_and_prefix_caching(mode):
    preamble = "You are a terse assistant. Answer in one short line, no pleasantries. " * 3
    prompts = [preamble + q for q in ("Name a color.", "Name a fruit.", "Count to five.", "Say hello.",
                                      "Name an ocean.", "Name a planet.")]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)
    options = dict(num_kv_blocks=20, block_size=16, preemption_mode=mode, admission_policy="optimistic",
                   max_num_seqs=6)
    # Tensor parallelism runs the GGUF dequantized (quantization none): so does the reference.
    one, s1 = run(None, 1, prompts, params, quantization="none", **options)
    two, s2 = run(None, 2, prompts, params, **options)
    assert s2.num_preemptions > 0 and s2.prefix_cache_hits > 0
    assert_same(one, two, atol=1e-3)


@pytest.mark.slow
def test_tp2_with_speculative_decoding_equals_tp1(tiny_models):
    """Only rank 0 verifies drafts: the other ranks learn how many were accepted from where each
    request's next chunk starts (runner/state.py), and keep the same KV and outputs."""
    path = with_tokenizer(tiny_models("llama_gqa").path)
    prompts = [{"prompt_token_ids": ([7, 8, 9, 10] * 6)[:n]} for n in (9, 14, 23)]   # repeats: n-gram drafts
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    one, _ = run(path, 1, prompts, num_kv_blocks=64)
    two, stats = run(path, 2, prompts, num_kv_blocks=64, speculative_config=spec)
    assert stats.spec_num_drafts > 0 and 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert_same(one, two)


@pytest.mark.slow
def test_a_dead_rank_fails_requests_and_then_the_engine(tiny_models):
    path = with_tokenizer(tiny_models("llama_gqa").path)
    prompt = [{"prompt_token_ids": random_prompts([12], seed=5)[0]}]
    with LLM(path, tensor_parallel_size=2, dtype="float32", num_kv_blocks=64, cost_model="none") as llm:
        assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"
        worker = llm.engine.runner.group.processes[0]
        worker.kill()
        worker.join()
        outs = [llm.generate(prompt, GREEDY, use_tqdm=False)[0] for _ in range(3)]
    assert all(o.outputs[0].finish_reason == "error" for o in outs)
    assert all("tensor-parallel" in o.error for o in outs)
    assert llm.engine.dead


@pytest.mark.slow
def test_the_engine_process_runs_a_tensor_parallel_engine(tiny_models):
    """What `conveyor serve --tensor-parallel-size 2` runs: the engine's process spawns the other rank."""
    import asyncio

    from conveyor.config import EngineConfig
    from conveyor.transport.process import ProcessEngine

    path = with_tokenizer(tiny_models("qwen3").path)
    prompt = random_prompts([20], seed=7)[0]
    want, _ = run(path, 1, [{"prompt_token_ids": prompt}], num_kv_blocks=64)
    engine = ProcessEngine(EngineConfig.from_options(model=path, tensor_parallel_size=2, dtype="float32",
                                                     num_kv_blocks=64, cost_model="none"))

    async def main():
        return [out async for out in engine.add_request(prompt, GREEDY, "a")]

    try:
        got = asyncio.run(main())
    finally:
        engine.close(timeout=5)
    assert got[-1].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert not engine._proc.is_alive()


@pytest.mark.slow
def test_tp2_prompt_logprobs_equal_tp1(tiny_models):
    """Prompt logprobs add logits rows: every rank must ask for the same rows (the gather matches)."""
    path = with_tokenizer(tiny_models("llama_gqa").path)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([30, 9], seed=11)]
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2)
    one, _ = run(path, 1, prompts, params, num_kv_blocks=64, max_num_batched_tokens=16)
    two, _ = run(path, 2, prompts, params, num_kv_blocks=64, max_num_batched_tokens=16)
    for a, b in zip(one, two):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys() and max(abs(x[k] - y[k]) for k in x) < 1e-4


@pytest.mark.slow
def test_tp2_embeddings_equal_tp1(tiny_models):
    """A step of embedding requests only has no logits rows: every rank skips the gather alike."""
    path = with_tokenizer(tiny_models("qwen2").path)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([21, 40], seed=12)]
    got = {}
    for tp in (1, 2):
        with LLM(path, tensor_parallel_size=tp, dtype="float32", num_kv_blocks=64, cost_model="none",
                 max_num_batched_tokens=16) as llm:
            got[tp] = [o.embedding for pooling in ("mean", "last") for o in llm.embed(prompts, pooling=pooling)]
    for a, b in zip(got[1], got[2], strict=True):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5
