"""The C++ GEMV equals the matmul it replaces; the fused decode loop equals the Python layer loop.

The GEMV accumulates exact products in fp32 and rounds once to the output dtype, so against an
fp64 reference it is within fp32 accumulation error (fp32) or half a bf16 ulp of the result plus
that error (bf16). The fused loop calls the same kernels in the same order as llama.py's layer
loop, so its logits must be bit-identical, and its greedy tokens equal transformers'.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.model.cpu_kernels import load_cpu_kernels
from conveyor.model.linear import CpuLinear
from conveyor.model.loader import build_model, load_weights
from model_testlib import assert_greedy_matches, conveyor_greedy, random_prompts

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="C++ kernels could not be built here")


def _operands(M, N, K, dtype, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(M, K, generator=g).to(dtype), torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8, 11])
@pytest.mark.parametrize("N,K", [(1, 1), (7, 40), (64, 576), (130, 1000)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_equals_fp64_matmul(dtype, M, N, K, bias):
    x, w, b = _operands(M, N, K, dtype, bias, seed=M * 1000 + N + K)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = kernels.gemv(x, w, b)
    assert got.dtype == dtype and got.shape == (M, N)
    scale = F.linear(x.double().abs(), w.double().abs()) + (0 if b is None else b.double().abs())
    rounding = 2.0 ** -8 * exact.abs() if dtype == torch.bfloat16 else 0
    assert ((got.double() - exact).abs() <= rounding + 1e-6 * scale + 1e-30).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_prefetch_switch_changes_no_result(dtype):
    """The probe-chosen switch (software prefetch in one-token passes) is speed only: the same
    bits either way, for every row count (only one-token passes read it)."""
    before = kernels.gemv_prefetch_single()
    try:
        for M in (1, 2, 9):
            x, w, b = _operands(M, 130, 1000, dtype, True, seed=M)
            kernels.set_gemv_prefetch_single(True)
            on = kernels.gemv(x, w, b)
            kernels.set_gemv_prefetch_single(False)
            assert not kernels.gemv_prefetch_single()
            assert torch.equal(kernels.gemv(x, w, b), on)
    finally:
        kernels.set_gemv_prefetch_single(before)


def test_gemv_rejects_bad_operands():
    x, w, _ = _operands(2, 8, 16, torch.float32, False, 0)
    with pytest.raises(RuntimeError):
        kernels.gemv(x, w[:, :8].contiguous(), None)                 # K differs
    with pytest.raises(RuntimeError):
        kernels.gemv(x.bfloat16(), w, None)                          # dtypes differ
    with pytest.raises(RuntimeError):
        kernels.gemv(x.t(), w[:, :2].contiguous(), None)             # not contiguous


@pytest.mark.parametrize("packed", [False, True])
def test_cpu_linear_dispatches_by_token_count(packed):
    x, w, b = _operands(9, 48, 64, torch.float32, True, 1)
    lin = CpuLinear(w, b, packed=packed, gemv_max=4)
    calls = []
    lin.kernels = type("Spy", (), {"gemv": lambda self, *a: calls.append(a[0].shape[0]) or kernels.gemv(*a)})()
    for m in (1, 4, 5, 9):
        torch.testing.assert_close(lin(x[:m]), F.linear(x[:m], w, b), atol=1e-4, rtol=1e-5)
    assert calls == [1, 4]   # above gemv_max: the packed weight or F.linear


def _forced_model(fam, dtype, monkeypatch):
    """The family's model with every matmul on the GEMV up to 8 tokens, whatever this CPU measures."""
    monkeypatch.setenv("CONVEYOR_GEMV", "off")
    monkeypatch.setenv("CONVEYOR_PACKED_LINEAR", "off")
    model = build_model(fam.cfg, load_weights(fam.path), dtype=dtype)
    model.cpu_linears(packed=False, gemv_max=8)
    assert model.fused_decode_tokens == 8
    return model


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2", "qwen3", "llama_tied", "gemma3", "mistral_swa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_equals_python_layer_loop(tiny_models, name, dtype, monkeypatch):
    _check_fused_decode(tiny_models, name, dtype, monkeypatch)


@pytest.mark.parametrize("name", ["llama_gqa", "mistral", "qwen3", "gemma3", "mqa_hd64", "mqa_hd128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_with_two_threads_equals_python_layer_loop(tiny_models, name, dtype, monkeypatch):
    """The fused loop is one parallel region whose threads share out every kernel's rows and the
    attention's heads (by KV head, or a KV head's query heads split when there are fewer KV heads
    than threads) and meet at barriers: with two threads (the rest of this directory runs on one) it
    still gives the Python loop's bits. GQA (one KV head: odd batches split the query heads), q/k
    norms, Gemma's GeGLU, extra norms and windows, and head sizes 64 and 128, where the attention
    has register-blocked kernels (128 with 4 query heads a KV head: the whole group takes the
    portable kernel, so a split share must too)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _check_fused_decode(tiny_models, name, dtype, monkeypatch)
    finally:
        torch.set_num_threads(prev)


def _check_fused_decode(tiny_models, name, dtype, monkeypatch):
    fam = tiny_models(name)
    model = _forced_model(fam, dtype, monkeypatch)
    fused_calls = []
    original = model._fused_decode
    monkeypatch.setattr(model, "_fused_decode", lambda *a: fused_calls.append(1) or original(*a))
    prompts = random_prompts([5, 19, 40, 2, 11, 7], seed=3)   # decode batches of 1-6 (both kernel shapes)
    fused = conveyor_greedy(model, prompts, 12, block_size=4, stagger=2, seed=1)
    assert fused_calls   # decode steps of 1-6 sequences took the fused path
    model.fused_decode_tokens = 0
    loop = conveyor_greedy(model, prompts, 12, block_size=4, stagger=2, seed=1)
    assert fused.tokens == loop.tokens
    for a, b in zip(fused.logits, loop.logits):
        assert torch.equal(a, b)
    if dtype == torch.float32:
        for i, prompt in enumerate(prompts):
            want, want_logits = fam.hf_greedy(prompt, 12)
            assert_greedy_matches(fused.tokens[i], want, fused.logits[i], want_logits, f"{name} prompt {i}")
