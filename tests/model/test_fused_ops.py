"""The fused C++ elementwise ops equal their torch definitions."""

from __future__ import annotations

import pytest
import torch

from conveyor.model.cpu_kernels import load_cpu_kernels
from conveyor.model.ops import CpuFusedOps, TorchOps, make_ops

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="C++ kernels could not be built here")
TOL = dict(atol=2e-5, rtol=1e-5)


@pytest.fixture
def ops():
    return CpuFusedOps(kernels), TorchOps()


@pytest.mark.parametrize("rows,dim", [(1, 576), (37, 64), (128, 1000)])
def test_rms_norm_and_fused_residual_add(ops, rows, dim):
    fused, ref = ops
    g = torch.Generator().manual_seed(rows)
    x, res, w = torch.randn(rows, dim, generator=g), torch.randn(rows, dim, generator=g), torch.rand(dim, generator=g)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), **TOL)
    r1, r2 = res.clone(), res.clone()
    torch.testing.assert_close(fused.add_rms_norm(x, r1, w, 1e-5), ref.add_rms_norm(x, r2, w, 1e-5), **TOL)
    torch.testing.assert_close(r1, r2, atol=0, rtol=0)   # the residual is updated in place, exactly


def test_silu_mul(ops):
    fused, ref = ops
    gate_up = torch.randn(19, 2 * 48) * 4
    torch.testing.assert_close(fused.silu_mul(gate_up), ref.silu_mul(gate_up), **TOL)


def test_gelu_tanh_mul(ops):
    """GeGLU (Gemma): torch's F.gelu(gate, tanh) * up; in bf16 the gelu is rounded before the
    product, as torch does it in bf16."""
    fused, ref = ops
    gate_up = torch.randn(19, 2 * 48) * 4
    torch.testing.assert_close(fused.gelu_tanh_mul(gate_up), ref.gelu_tanh_mul(gate_up), **TOL)
    b = gate_up.bfloat16()
    got, want = fused.gelu_tanh_mul(b), ref.gelu_tanh_mul(b)
    assert got.dtype == torch.bfloat16
    assert (got != want).float().mean() < 0.02   # an fp32 ulp of the tanh may round the other way
    torch.testing.assert_close(got, want, **BF16)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 24)])
def test_rope_in_place_on_views_of_a_fused_qkv(ops, heads, kv_heads, head_dim):
    fused, ref = ops
    T, max_pos = 11, 300
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim)
    positions = torch.randint(0, max_pos, (T,))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), torch.rand(head_dim // 2))
    cos, sin = freqs.cos(), freqs.sin()

    def views(buf):
        q, k, _ = buf.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        return q.view(T, heads, head_dim), k.view(T, kv_heads, head_dim)

    q_ref, k_ref = ref.rope(*views(qkv.clone()), positions, cos, sin)
    buf = qkv.clone()
    q, k = fused.rope(*views(buf), positions, cos, sin)
    torch.testing.assert_close(q, q_ref, **TOL)
    torch.testing.assert_close(k, k_ref, **TOL)
    torch.testing.assert_close(buf[:, (heads + kv_heads) * head_dim:], qkv[:, (heads + kv_heads) * head_dim:],
                               atol=0, rtol=0)   # v untouched


def test_fused_ops_are_the_default_on_cpu_fp32_and_bf16():
    assert isinstance(make_ops("cpu", torch.float32), CpuFusedOps)
    assert isinstance(make_ops("cpu", torch.bfloat16), CpuFusedOps)
    assert type(make_ops("cpu", torch.float16)) is TorchOps


# bf16 storage, fp32 math: each result is the fp32 result rounded once to bf16 (relative error
# 2^-8), give or take the order of the fp32 reductions: two bf16 ulps.
BF16 = dict(atol=1e-2, rtol=8e-3)


def test_bf16_rms_norm_silu_and_residual_add_are_rounded_fp32(ops):
    fused, ref = ops
    g = torch.Generator().manual_seed(5)
    x, res = torch.randn(33, 576, generator=g).bfloat16(), torch.randn(33, 576, generator=g).bfloat16()
    w = (torch.rand(576, generator=g) + 0.5).bfloat16()
    want = ref.rms_norm(x.float(), w.float(), 1e-5).bfloat16()
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-5), want, **BF16)
    r1, r2 = res.clone(), res.clone()
    out = fused.add_rms_norm(x, r1, w, 1e-5)
    r2.add_(x)                                     # bf16 add: fp32 sum rounded once, as the kernel does
    torch.testing.assert_close(r1, r2, atol=0, rtol=0)
    torch.testing.assert_close(out, ref.rms_norm(r2.float(), w.float(), 1e-5).bfloat16(), **BF16)
    gate_up = (torch.randn(19, 2 * 48, generator=g) * 4).bfloat16()
    torch.testing.assert_close(fused.silu_mul(gate_up), ref.silu_mul(gate_up.float()).bfloat16(), **BF16)


def test_bf16_rope_in_place(ops):
    fused, ref = ops
    T, heads, d, max_pos = 9, 4, 64, 200
    q = torch.randn(T, heads, d).bfloat16()
    positions = torch.randint(0, max_pos, (T,))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), torch.rand(d // 2))
    want, _ = ref.rope(q.float(), q.float(), positions, freqs.cos(), freqs.sin())
    got, _ = fused.rope(q.clone(), q.clone(), positions, freqs.cos(), freqs.sin())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want.bfloat16(), **BF16)
