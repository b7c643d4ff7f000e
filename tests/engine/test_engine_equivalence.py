"""Greedy output must not depend on batching, chunking, preemption or prefix caching."""

from __future__ import annotations

import random

import pytest

from conveyor.engine.engine import InvalidRequestError
from conveyor.sampling.params import SamplingParams

from engine_testlib import run_all

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def make_prompts(n: int = 10, seed: int = 1, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(256) for _ in range(rng.randint(3, 90))] for _ in range(n)]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def check_blocks(engine):
    engine.kv.check_invariants()


@pytest.fixture(scope="module")
def alone(make_engine):
    """Each request run by itself in a fresh engine: the reference."""
    prompts = make_prompts()
    return prompts, [tokens(run_all(make_engine(), [p], GREEDY))[0] for p in prompts]


def test_batched_equals_alone(make_engine, alone):
    prompts, ref = alone
    engine = make_engine()
    assert tokens(run_all(engine, prompts, GREEDY, check=check_blocks)) == ref
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("chunk", [16, 512])
def test_chunk_size_does_not_matter(make_engine, alone, chunk):
    prompts, ref = alone
    engine = make_engine(max_num_batched_tokens=max(chunk, 128), long_prefill_token_threshold=chunk)
    assert tokens(run_all(engine, prompts, GREEDY, check=check_blocks)) == ref


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_preemption_does_not_change_output(make_engine, alone, mode):
    prompts, ref = alone
    # 24 blocks of 8 tokens cannot hold 10 requests of up to 130 tokens: forces preemption.
    engine = make_engine(num_kv_blocks=24, block_size=8, preemption_mode=mode, admission_policy="optimistic",
                         min_resident_steps=1)
    assert tokens(run_all(engine, prompts, GREEDY, check=check_blocks)) == ref
    stats = engine.stats()
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_swaps_out > 0 and stats.num_swaps_in == stats.num_swaps_out
    if mode == "recompute":
        assert stats.num_recomputes > 0 and stats.num_swaps_out == 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert engine.kv.host.num_free == engine.kv.host.num_blocks


def test_swap_falls_back_to_recompute_when_host_pool_is_full(make_engine, alone):
    prompts, ref = alone
    engine = make_engine(num_kv_blocks=24, block_size=8, preemption_mode="swap", admission_policy="optimistic",
                         swap_space_gib=1e-6, min_resident_steps=1)
    assert tokens(run_all(engine, prompts, GREEDY, check=check_blocks)) == ref
    assert engine.stats().num_recomputes > 0


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_caching_does_not_change_output(make_engine, caching):
    prompts = make_prompts(8, seed=3, shared_prefix=40)
    ref = [tokens(run_all(make_engine(enable_prefix_caching=False), [p], GREEDY))[0] for p in prompts]
    engine = make_engine(enable_prefix_caching=caching, block_size=8)
    # staggered: the first request fills the cache before the others arrive
    first = tokens(run_all(engine, prompts[:1], GREEDY, check=check_blocks))
    rest = tokens(run_all(engine, prompts[1:], GREEDY, check=check_blocks))
    assert first + rest == ref
    stats = engine.stats()
    if caching:
        assert stats.prefix_cache_hits >= 7 * (40 // 8)
        assert stats.prefix_cache_hit_rate > 0.3
    else:
        assert stats.prefix_cache_hits == 0


def test_n_shares_prompt_blocks(make_engine):
    prompt = make_prompts(1, seed=5)[0] + list(range(64))
    engine = make_engine(block_size=8)
    params = SamplingParams(temperature=0.9, max_tokens=12, n=3, seed=7, ignore_eos=True)
    out = run_all(engine, [prompt], params, check=check_blocks)[0]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 12 for c in out.outputs)
    full_blocks = (len(prompt) - 1) // 8
    assert engine.stats().prefix_cache_hits >= 2 * full_blocks
    # siblings with seeds 7, 8, 9 equal the same requests run alone with those seeds
    for i, c in enumerate(out.outputs):
        alone = SamplingParams(temperature=0.9, max_tokens=12, seed=7 + i, ignore_eos=True)
        assert run_all(make_engine(), [prompt], alone)[0].outputs[0].token_ids == c.token_ids


def test_abort_frees_everything(make_engine):
    engine = make_engine(num_kv_blocks=64, block_size=8)
    ids = [engine.add_request(p, GREEDY) for p in make_prompts(6, seed=9)]
    for _ in range(5):
        engine.step()
    assert engine.kv.num_free_blocks < engine.kv.num_blocks
    for rid in ids[::2]:
        engine.abort_request(rid)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        engine.kv.check_invariants()
    assert {outs[r].outputs[0].finish_reason for r in ids[::2]} == {"abort"}
    assert {outs[r].outputs[0].finish_reason for r in ids[1::2]} == {"length"}
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_bad_request_is_rejected_alone(make_engine):
    """An invalid request raises at add time and queues nothing; the others run as usual."""
    engine = make_engine(num_kv_blocks=16, block_size=8)
    good = make_prompts(2, seed=11)
    params = SamplingParams(temperature=0, max_tokens=8)
    ids = [engine.add_request(good[0], params)]
    with pytest.raises(InvalidRequestError, match="context"):
        engine.add_request(list(range(200)) * 6, params)      # longer than the 1024-token context
    with pytest.raises(InvalidRequestError, match="KV cache"):
        engine.add_request(list(range(200)), params)          # 200 tokens > 16 blocks * 8
    ids.append(engine.add_request(good[1], params))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert sorted(outs) == sorted(ids) and all(o.outputs[0].finish_reason == "length" for o in outs.values())
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_finished_requests_leave_in_the_same_step(make_engine):
    engine = make_engine()
    engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.step()
    (out,) = engine.step()
    assert out.finished and len(out.outputs[0].token_ids) == 2
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert not engine.has_unfinished_requests()


def test_a_request_cannot_outgrow_the_whole_cache(make_engine):
    # 4 blocks of 16 tokens: prompt 10 + max_tokens 100 would need 7 blocks. The request is
    # capped at the cache size and finishes by length instead of preempting itself forever.
    engine = make_engine(num_kv_blocks=4, block_size=16)
    (out,) = run_all(engine, [list(range(10))], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 64 - 10
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_usage == 0.0
