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


def test_fused_ops_are_the_default_on_cpu_fp32():
    assert isinstance(make_ops("cpu", torch.float32), CpuFusedOps)
    assert type(make_ops("cpu", torch.bfloat16)) is TorchOps
