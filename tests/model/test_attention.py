"""Paged attention (TorchPagedAttention + build_inputs metadata) vs dense causal softmax attention.

Each sequence has fixed random q/k/v for all its positions; a schedule feeds them to the paged
kernel in steps (prefill chunks with or without cached context, single-token decodes, mixed),
and every output row must equal plain softmax attention over the sequence's prefix, computed
in float64. Inputs are O(1) fp32, outputs are convex combinations of O(1) values: the only
error is fp32 rounding in a <= 300-long softmax and a 16..32-long dot product, ~1e-6, so
atol 1e-5 (rtol 1e-5) is tight yet stable.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.model.attention import CpuPagedAttention, TorchPagedAttention
from conveyor.model.cpu_kernels import cpu_kernels
from conveyor.runner.inputs import SeqWork, build_inputs
from model_testlib import allocate_tables

ATOL = RTOL = 1e-5


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    window: int = 0) -> torch.Tensor:
    """q: [n, H, d] at ``positions``; k, v: [L, KVH, d] for positions 0..L-1. Returns [n, H * d].
    window > 0: a query sees its last `window` positions only."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)   # head h uses kv head h // group
    scores = torch.einsum("nhd,lhd->hnl", q, k) / math.sqrt(q.shape[-1])
    causal = torch.arange(k.shape[0])[None, :] <= positions[:, None]              # [n, L]
    if window:
        causal &= torch.arange(k.shape[0])[None, :] > positions[:, None] - window
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", probs, v).reshape(q.shape[0], -1)


def run_schedule(lengths: list[int], steps: list[list[tuple[int, int]]], *, heads: int, kv_heads: int,
                 head_dim: int, block_size: int, seed: int = 0, window: int = 0, attn=None,
                 outputs: dict | None = None) -> int:
    """Feed sequences of ``lengths`` tokens through paged attention (`attn`: the portable backend
    unless given), ``steps`` being lists of (sequence, tokens this step); check every output row
    (and keep them in ``outputs[sequence]``, in order). Returns the number of rows checked."""
    g = torch.Generator().manual_seed(seed)
    qs = [torch.randn(n, heads, head_dim, generator=g) for n in lengths]
    ks = [torch.randn(n, kv_heads, head_dim, generator=g) for n in lengths]
    vs = [torch.randn(n, kv_heads, head_dim, generator=g) for n in lengths]
    tables, num_blocks = allocate_tables(lengths, block_size, seed)
    # Garbage everywhere: a read of an unwritten slot or of another sequence's block shows up.
    k_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g) * 10
    v_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g) * 10
    attn = attn or TorchPagedAttention(heads, kv_heads, head_dim)
    done = [0] * len(lengths)
    checked = 0
    for step in steps:
        work = [SeqWork([0] * n, done[s], tables[s]) for s, n in step]
        inp = build_inputs(work, block_size)
        laid_out = [(step[i][0], done[step[i][0]], step[i][1]) for i in inp.order]
        q = torch.cat([qs[s][a:a + n] for s, a, n in laid_out])
        k = torch.cat([ks[s][a:a + n] for s, a, n in laid_out])
        v = torch.cat([vs[s][a:a + n] for s, a, n in laid_out])
        out = attn(q, k, v, k_cache, v_cache, inp.meta, window)
        at = 0
        for s, a, n in laid_out:
            assert torch.equal(inp.positions[at:at + n], torch.arange(a, a + n))
            want = dense_attention(qs[s][a:a + n], ks[s][:a + n], vs[s][:a + n], torch.arange(a, a + n), window)
            torch.testing.assert_close(out[at:at + n].double(), want, atol=ATOL, rtol=RTOL,
                                       msg=lambda m: f"seq {s} positions {a}..{a + n - 1}: {m}")
            if outputs is not None:
                outputs.setdefault(s, []).append(out[at:at + n].clone())
            at += n
            done[s] += n
            checked += n
    return checked


BLOCK_SIZES = [1, 2, 3, 16, 64, 256]
HEADS = [(4, 4, 16), (4, 2, 16), (8, 1, 24)]   # (heads, kv_heads, head_dim): MHA, GQA, MQA


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", HEADS)
def test_prefill_from_scratch(block_size, heads, kv_heads, head_dim):
    for n in (1, 5, block_size, block_size + 1, 70):
        run_schedule([n], [[(0, n)]], heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", HEADS)
def test_chunk_after_cached_context(block_size, heads, kv_heads, head_dim):
    # Chunks that start and end inside blocks, exactly on block boundaries, and span several blocks.
    sizes = [10, 13, 1, 2, block_size, 40]
    run_schedule([sum(sizes)], [[(0, n)] for n in sizes], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                 block_size=block_size)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", HEADS)
def test_decode(block_size, heads, kv_heads, head_dim):
    # Three sequences of different context lengths decode together (padded block tables).
    lengths = [20 + 12, 3 + 12, 50 + 12]
    steps = [[(0, 20)], [(1, 3)], [(2, 50)]] + [[(0, 1), (1, 1), (2, 1)]] * 12
    run_schedule(lengths, steps, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", HEADS)
def test_mixed_batch(block_size, heads, kv_heads, head_dim):
    """One step holds a fresh prefill, a continuing chunk, a one-token prompt and decodes."""
    lengths = [9, 17 + 5, 30 + 1, 4 + 1, 1, 6 + 1]
    steps = [[(1, 17), (2, 30), (3, 4)],
             [(3, 1), (0, 9), (2, 1), (1, 5), (4, 1), (5, 6)],
             [(5, 1)]]
    run_schedule(lengths, steps, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size)


@settings(max_examples=40, deadline=None)
@given(block_size=st.sampled_from([1, 2, 5, 16, 256]), heads=st.sampled_from(HEADS),
       lengths=st.lists(st.integers(1, 60), min_size=1, max_size=5), seed=st.integers(0, 2**16))
def test_random_schedules(block_size, heads, lengths, seed):
    """Any interleaving of chunks (of any size) and decodes gives dense attention's output."""
    rng = random.Random(seed)
    done = [0] * len(lengths)
    steps = []
    while any(d < n for d, n in zip(done, lengths)):
        live = [s for s in range(len(lengths)) if done[s] < lengths[s]]
        chosen = rng.sample(live, rng.randint(1, len(live)))
        step = []
        for s in chosen:
            n = min(lengths[s] - done[s], rng.choice([1, 1, 2, 3, 7, 20]))
            step.append((s, n))
            done[s] += n
        steps.append(step)
    h, kvh, d = heads
    assert run_schedule(lengths, steps, heads=h, kv_heads=kvh, head_dim=d, block_size=block_size,
                        seed=seed) == sum(lengths)


@settings(max_examples=40, deadline=None)
@given(block_size=st.sampled_from([1, 2, 5, 16]), window=st.sampled_from([1, 3, 8, 20]),
       lengths=st.lists(st.integers(1, 60), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_sliding_window_schedules(block_size, window, lengths, seed):
    """Sliding-window layers: chunks after a cached context longer than the window (whose blocks
    before the window are not gathered) and decodes give windowed dense attention's output."""
    rng = random.Random(seed)
    done = [0] * len(lengths)
    steps = []
    while any(d < n for d, n in zip(done, lengths)):
        step = []
        for s in [s for s in range(len(lengths)) if done[s] < lengths[s]]:
            n = min(lengths[s] - done[s], rng.choice([1, 2, 7, 20]))
            step.append((s, n))
            done[s] += n
        steps.append(step)
    assert run_schedule(lengths, steps, heads=4, kv_heads=2, head_dim=16, block_size=block_size, seed=seed,
                        window=window) == sum(lengths)


@pytest.mark.skipif(cpu_kernels("cpu", torch.float32) is None, reason="C++ kernels not built here")
@settings(max_examples=30, deadline=None)
@given(block_size=st.sampled_from([1, 3, 16]), heads=st.sampled_from(HEADS), window=st.sampled_from([0, 1, 3, 8]),
       lengths=st.lists(st.integers(1, 50), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_rowwise_prefill_gives_each_token_its_decode_bits(block_size, heads, window, lengths, seed):
    """Prompts' attention through the decode kernel query by query (``rowwise_prefill``, the
    batch-invariant mode): right (dense attention's output, windowed too), and each row the same
    bits as that token computed alone as a decode step, whatever chunks it came in."""
    h, kvh, d = heads
    attn = CpuPagedAttention(h, kvh, d, cpu_kernels("cpu", torch.float32))
    attn.rowwise_prefill = True
    rng = random.Random(seed)
    done, chunked = [0] * len(lengths), []
    while any(x < n for x, n in zip(done, lengths)):
        step = []
        for s in [s for s in range(len(lengths)) if done[s] < lengths[s]]:
            step.append((s, min(lengths[s] - done[s], rng.choice([1, 2, 7, 20]))))
            done[s] += step[-1][1]
        chunked.append(step)
    one_by_one = [[(s, 1) for s in range(len(lengths)) if p < lengths[s]] for p in range(max(lengths))]
    got, want = {}, {}
    for steps, out in ((chunked, got), (one_by_one, want)):
        run_schedule(lengths, steps, heads=h, kv_heads=kvh, head_dim=d, block_size=block_size, seed=seed,
                     window=window, attn=attn, outputs=out)
    for s in range(len(lengths)):
        assert torch.equal(torch.cat(got[s]), torch.cat(want[s])), f"sequence {s}"
