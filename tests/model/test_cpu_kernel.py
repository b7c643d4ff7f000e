"""The C++ decode kernel equals the portable torch path (and is picked by default on CPU fp32)."""

from __future__ import annotations

import random

import pytest
import torch

from conveyor.model.attention import CpuPagedAttention, TorchPagedAttention, make_attention_backend
from conveyor.model.cpu_kernels import load_cpu_kernels
from conveyor.runner.inputs import SeqWork, build_inputs

kernels = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="C++ kernels could not be built here")


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 24), (8, 1, 128), (6, 2, 32), (4, 1, 256)])
@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("window", [0, 37])   # 37: a sliding-window layer (starts mid-block)
def test_kernel_matches_torch_path(heads, kv_heads, head_dim, block_size, window):
    rng = random.Random(heads * 1000 + block_size)
    g = torch.Generator().manual_seed(block_size)
    lens = [rng.randint(1, 300) for _ in range(7)] + [1, 300]
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    work, at = [], 0
    for n in lens:
        nb = -(-n // block_size)
        work.append(SeqWork([0], n - 1, ids[at:at + nb]))
        at += nb
    k_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g)
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    k = torch.randn(len(lens), kv_heads, head_dim, generator=g)
    v = torch.randn(len(lens), kv_heads, head_dim, generator=g)
    outs = []
    for backend in (TorchPagedAttention(heads, kv_heads, head_dim),
                    CpuPagedAttention(heads, kv_heads, head_dim, kernels)):
        inputs = build_inputs(work, block_size, max_decode_groups=backend.max_decode_groups)
        kc, vc = k_cache.clone(), v_cache.clone()
        perm = torch.tensor(inputs.order)
        outs.append(backend(q[perm], k[perm], v[perm], kc, vc, inputs.meta, window))
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-5)
    if window:   # and the window changes the result of the sequences longer than it
        full = CpuPagedAttention(heads, kv_heads, head_dim, kernels)(
            q[perm], k[perm], v[perm], k_cache.clone(), v_cache.clone(), inputs.meta)
        lens_in_order = torch.tensor([lens[i] for i in inputs.order])
        long = (lens_in_order > window).nonzero().view(-1)
        assert not torch.allclose(full[long], outs[1][long])
        short = (lens_in_order <= window).nonzero().view(-1)
        torch.testing.assert_close(full[short], outs[1][short], atol=0, rtol=0)


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (8, 1, 128, 1), (6, 2, 32, 7)])
def test_bf16_cache_is_read_in_place_with_fp32_math(heads, kv_heads, head_dim, block_size):
    """bf16 queries and cache: the fp32 attention of the same (bf16-valued) numbers, rounded once."""
    g = torch.Generator().manual_seed(head_dim)
    lens = [1, 5, 63, 200, 17]
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    ids = torch.randperm(num_blocks, generator=g).tolist()
    work, at = [], 0
    for n in lens:
        nb = -(-n // block_size)
        work.append(SeqWork([0], n - 1, ids[at:at + nb]))
        at += nb
    k_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g).bfloat16()
    v_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g).bfloat16()
    q, k, v = (torch.randn(len(lens), h, head_dim, generator=g).bfloat16() for h in (heads, kv_heads, kv_heads))
    inputs = build_inputs(work, block_size, max_decode_groups=1)
    perm = torch.tensor(inputs.order)
    ref = TorchPagedAttention(heads, kv_heads, head_dim)(q[perm].float(), k[perm].float(), v[perm].float(),
                                                         k_cache.float(), v_cache.float(), inputs.meta)
    kc, vc = k_cache.clone(), v_cache.clone()
    got = CpuPagedAttention(heads, kv_heads, head_dim, kernels)(q[perm], k[perm], v[perm], kc, vc, inputs.meta)
    assert got.dtype == torch.bfloat16
    # outputs are convex combinations of O(1) values: one bf16 rounding is below 1e-2
    torch.testing.assert_close(got.float(), ref, atol=1e-2, rtol=8e-3)


@needs_kernels
def test_default_backend_on_cpu_is_the_kernel():
    assert isinstance(make_attention_backend(4, 2, 16, "cpu", torch.float32), CpuPagedAttention)
    assert isinstance(make_attention_backend(4, 2, 16, "cpu", torch.bfloat16), CpuPagedAttention)
    assert type(make_attention_backend(4, 2, 16, "cpu", torch.float16)) is TorchPagedAttention


def test_kernels_build_on_this_machine():
    # Not skipped: gcc and the ninja package are part of the setup, so a failed build
    # (e.g. ninja not on PATH outside an activated venv) must show up as a failure.
    import os
    import shutil

    if os.environ.get("CONVEYOR_KERNELS") == "torch" or shutil.which("g++") is None:
        pytest.skip("kernels disabled or no C++ compiler")
    assert load_cpu_kernels() is not None


@needs_kernels
@pytest.mark.skipif(kernels is not None and kernels.attn_prefetch() == 0,
                    reason="the AVX-512 kernel (the one that prefetches) is not built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_how_far_ahead_attention_prefetches_changes_no_result(dtype):
    """The L2 prefetch (set_attn_prefetch) only asks for rows early: every distance gives the bits of
    none, over shuffled tables, contexts shorter than the distance and not whole blocks, and a window
    (rows from mid-table). The last sequence's table ends on the cache's last block, so a prefetch
    cursor that ran past its context would read past the table."""
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    g = torch.Generator().manual_seed(7)
    lens = [1, 15, 16, 17, 64, 65, 300, 1000]
    num_blocks = sum(-(-n // block_size) for n in lens)
    ids = torch.randperm(num_blocks - 1, generator=g).tolist() + [num_blocks - 1]
    tables = torch.zeros(len(lens), max(-(-n // block_size) for n in lens), dtype=torch.int64)
    at = num_blocks
    for i in reversed(range(len(lens))):
        nb = -(-lens[i] // block_size)
        tables[i, :nb] = torch.tensor(ids[at - nb:at])
        at -= nb
    assert tables[-1, -(-lens[-1] // block_size) - 1] == num_blocks - 1
    k_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g).to(dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    context = torch.tensor(lens)
    default = kernels.attn_prefetch()
    try:
        for window in (0, 37):
            kernels.set_attn_prefetch(0)
            ref = kernels.paged_decode(q, k_cache, v_cache, tables, context, head_dim ** -0.5, window)
            for ahead in (1, 16, 64, 5000):
                kernels.set_attn_prefetch(ahead)
                got = kernels.paged_decode(q, k_cache, v_cache, tables, context, head_dim ** -0.5, window)
                assert torch.equal(got, ref), (window, ahead)
    finally:
        kernels.set_attn_prefetch(default)
    assert default == 64
    with pytest.raises(RuntimeError):
        kernels.set_attn_prefetch(-1)
