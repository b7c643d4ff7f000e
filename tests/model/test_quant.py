"""GGUF-quantized weights computed as stored (conveyor/model/quant.py, csrc/quant_cpu.cpp).

The reference is the `gguf` package's own dequantization: with fp32 activations the kernels must
compute x W^T with exactly its dense W (only the order of the sums differs), and a model loaded
with its Q4_0/Q4_1/Q8_0 weights kept as stored must give the logits of the same model
dequantized at load (``--quantization none``), through prefill chunks, the fused decode loop and
a tied LM head. The int8-activation kernel (interleaved layout) must compute exactly the integer
arithmetic of its definition: activations rounded per block of 32 to int8 with scale max|x|/127.
"""

from __future__ import annotations

import gguf
import gguf.quants
import numpy as np
import pytest
import torch

from conveyor.model.cpu_kernels import load_cpu_kernels
from conveyor.model.gguf_loader import convert_gguf, gguf_native_weights
from conveyor.model.loader import build_model, load_weights, read_config
from conveyor.model.quant import (BLOCK, FUSED_INT8_TOKENS, K_SUPER_BYTES, NATIVE_BLOCK_BYTES, SUPER, QuantLinear,
                                  QuantTensor, dense_module)
from model_testlib import conveyor_greedy, conveyor_prompt_logits, logit_atol, random_prompts
from test_loader import _write_tiny_gguf

KERNELS = load_cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="C++ kernels not built here")
QTYPES = sorted(NATIVE_BLOCK_BYTES)


def _quantized(qtype: str, rows: int, cols: int, seed: int = 0) -> tuple[QuantTensor, torch.Tensor]:
    a = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    kind = gguf.GGMLQuantizationType[qtype]
    data = gguf.quants.quantize(a, kind)
    dense = torch.from_numpy(gguf.quants.dequantize(data, kind).astype(np.float32))
    return QuantTensor(torch.from_numpy(np.ascontiguousarray(data)), qtype, cols), dense


@pytest.mark.parametrize("qtype", QTYPES)
def test_kernels_compute_the_gguf_dequantization(qtype):
    # 37 rows: leftovers after the kernel's 2- and 4-row groups; 13 tokens: a full and a partial pass.
    w, dense = _quantized(qtype, 37, 96)
    assert w.data.shape == (37, 3 * NATIVE_BLOCK_BYTES[qtype])
    assert torch.equal(KERNELS.qdequant(w.data, 96, torch.float32), dense)
    assert torch.equal(KERNELS.qdequant(w.data, 96, torch.bfloat16), dense.bfloat16())
    g = torch.Generator().manual_seed(0)
    bias = torch.randn(37, generator=g)
    for tokens in (1, 2, 3, 8, 13):
        x = torch.randn(tokens, 96, generator=g)
        want = torch.nn.functional.linear(x, dense, bias)
        torch.testing.assert_close(KERNELS.qgemv(x, w.data, bias), want, rtol=1e-5, atol=1e-5)
        x16, b16 = x.bfloat16(), bias.bfloat16()
        got16 = KERNELS.qgemv(x16, w.data, b16)   # bf16: the weights rounded to bf16, as a bf16 model's
        assert got16.dtype == torch.bfloat16
        want16 = torch.nn.functional.linear(x16.double(), dense.bfloat16().double(), b16.double())
        torch.testing.assert_close(got16.double(), want16, rtol=1e-2, atol=1e-2)   # the output's bf16 rounding


def _int8_reference(x: torch.Tensor, w: QuantTensor, dense: torch.Tensor, plain: bool = False) -> torch.Tensor:
    """x W^T with x per block of 32 as two int8 terms, x ~ d q + d2 q2 (d = max|x| / 127,
    d2 = d / 254, ties to even), in fp64; Q4_1's and Q5_1's minima multiply the exact block sums of x."""
    m, k = x.shape
    xb = x.view(m, k // BLOCK, BLOCK)
    amax = xb.abs().amax(-1, keepdim=True)
    d = amax / 127
    q = torch.where(amax > 0, torch.round(xb * (127 / amax)), 0.0)
    d2 = d / 254
    q2 = torch.where(amax > 0, torch.round((xb - d * q) * (1 / d2)).clamp(-127, 127), 0.0)
    xq = (q.double() * d.double() + q2.double() * d2.double()).view(m, k)
    if plain or w.qtype not in ("Q4_1", "Q5_1"):
        return xq @ dense.double().T
    raw = w.data.view(w.out_features, k // BLOCK, NATIVE_BLOCK_BYTES[w.qtype])
    mins = raw[:, :, 2:4].contiguous().view(torch.float16).double().squeeze(-1)   # [out, blocks]
    return xq @ (dense.double() - mins.repeat_interleave(BLOCK, 1)).T + xb.double().sum(-1) @ mins.T


@pytest.mark.skipif(KERNELS is None or not KERNELS.quant_int8_native(), reason="no AVX512-VNNI here")
@pytest.mark.parametrize("qtype", QTYPES)
def test_int8_kernel_computes_its_definition(qtype):
    w, dense = _quantized(qtype, 48, 96, seed=1)
    r = w.for_int8()
    assert r.x16 and r.out_features == 48 and r.data.numel() == w.data.numel()
    assert torch.equal(KERNELS.qdequant(r.data, 96, torch.float32), dense)   # the same bytes, reordered
    ids = torch.tensor([[3, 0], [47, 17]])
    assert torch.equal(KERNELS.qembedding(r.data, ids, 96, torch.float32), dense[ids.view(-1)])
    assert torch.equal(KERNELS.qembedding(w.data, ids, 96, torch.float32), dense[ids.view(-1)])
    g = torch.Generator().manual_seed(1)
    for tokens in (1, 3, 8, 11):
        x = torch.randn(tokens, 96, generator=g)
        x[0, :32] = 0   # an all-zero block: scale 0
        want = _int8_reference(x, w, dense)
        got = KERNELS.qgemv(x, r.data, None).double()
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        exact = x.double() @ dense.double().T   # and two int8 terms are ~15 bits: near the exact product
        assert (got - exact).abs().max() <= 1e-4 * exact.abs().max()


@pytest.mark.skipif(KERNELS is None or not KERNELS.int8_amx(), reason="no AMX-INT8 here")
@pytest.mark.parametrize("qtype", QTYPES)
def test_amx_tiles_give_each_token_its_vnni_bits(qtype):
    """Steps of 16 tokens or more run whole tiles of 16 on AMX and the rest on VNNI: each token's
    outputs are the bits it gets alone (one token: VNNI), in fp32 and bf16, with a bias, an all-zero
    block, 1-5 tiles (a pass takes 4) and more 16-row groups than threads."""
    w, _ = _quantized(qtype, 80, 192, seed=5)
    data = w.for_int8().data
    g = torch.Generator().manual_seed(5)
    bias = torch.randn(80, generator=g)
    for tokens in (16, 21, 32, 64, 83):
        x = torch.randn(tokens, 192, generator=g)
        x[tokens // 2, 32:64] = 0
        for dtype in (torch.float32, torch.bfloat16):
            xd, bd = x.to(dtype), bias.to(dtype)
            alone = torch.cat([KERNELS.qgemv(xd[i:i + 1], data, bd) for i in range(tokens)])
            assert torch.equal(KERNELS.qgemv(xd, data, bd), alone), (tokens, dtype)
            try:
                KERNELS.set_int8_amx(False)
                assert torch.equal(KERNELS.qgemv(xd, data, bd), alone)   # VNNI at every size
            finally:
                KERNELS.set_int8_amx(True)


@pytest.mark.skipif(KERNELS is None or not KERNELS.quant_int8_native(), reason="no AVX512-VNNI here")
def test_int8_kernels_give_the_same_bits_on_two_threads():
    """A prefill's activations are quantized by both threads (more than 256 blocks) and its rows
    shared out: the bits of one thread. (Regression: the quantized activations once lived in a
    thread-local buffer that the second thread, naming it, found empty.)"""
    w, _ = _quantized("Q4_1", 48, 96, seed=3)
    k, _ = _random_k("Q6_K", 48, 512, seed=4)
    g = torch.Generator().manual_seed(3)
    cases = [(w.for_int8().data, torch.randn(100, 96, generator=g)), (k.for_int8().data, torch.randn(40, 512, generator=g))]
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [KERNELS.qgemv(x, data, None) for data, x in cases]
        torch.set_num_threads(2)
        two = [KERNELS.qgemv(x, data, None) for data, x in cases]
    finally:
        torch.set_num_threads(prev)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


@pytest.mark.parametrize("qtype", QTYPES)
def test_bf16_activations_multiply_the_bf16_models_weights(qtype):
    """In bf16 the blocks are rounded to bf16 before multiplying: the dequantized bf16 model's
    weights, so its dense paths (the GEMV here, the held copy for large steps) and this kernel
    compute the same products, and a step's size does not change a bf16 model's numbers."""
    w, dense = _quantized(qtype, 37, 96, seed=4)
    dense16 = dense.bfloat16()
    for tokens in (1, 5, 11):
        x = torch.randn(tokens, 96, generator=torch.Generator().manual_seed(tokens)).bfloat16()
        assert torch.equal(KERNELS.qgemv(x, w.data, None), KERNELS.gemv(x, dense16, None))


def _random_k(qtype: str, rows: int, cols: int, seed: int) -> tuple[QuantTensor, torch.Tensor]:
    """Random K-quant super-blocks (gguf cannot quantize to K types): random codes (Q5_K: and fifth
    bits; Q3_K: and high bits), 6-bit scales and minima (Q4_K, Q5_K), 4-bit ones (Q2_K), 6-bit scales
    (Q3_K) or int8 scales (Q6_K), small fp16 super-block scales;
    the reference is gguf's dequantization."""
    g = np.random.default_rng(seed)
    nbytes = K_SUPER_BYTES[qtype]
    data = g.integers(0, 256, (rows, cols // SUPER, nbytes), dtype=np.uint8)
    d = (g.random((rows, cols // SUPER, 2)) * 0.02 + 0.001).astype(np.float16).view(np.uint8)
    if qtype in ("Q4_K", "Q5_K"):
        data[:, :, 0:4] = d.reshape(rows, cols // SUPER, 4)
    elif qtype == "Q2_K":   # d, dmin: the last 4 bytes
        data[:, :, 80:84] = d.reshape(rows, cols // SUPER, 4)
    else:   # d is the last 2 bytes
        data[:, :, nbytes - 2:nbytes] = d[:, :, :2]
    data = np.ascontiguousarray(data.reshape(rows, -1))
    kind = gguf.GGMLQuantizationType[qtype]
    dense = torch.from_numpy(gguf.quants.dequantize(data, kind).astype(np.float32))
    return QuantTensor(torch.from_numpy(data), qtype, cols), dense


def _k_mins(w: QuantTensor) -> torch.Tensor:
    """Q4_K's / Q5_K's minimum per row and block of 32 (dmin times the 6-bit minimum), from the plain
    bytes."""
    nbytes = K_SUPER_BYTES[w.qtype]
    raw = w.data.view(w.out_features, -1, nbytes).long()
    dmin = w.data.view(w.out_features, -1, nbytes)[:, :, 2:4].contiguous().view(torch.float16).double()  # [rows, sb, 1]
    sc = raw[:, :, 4:16]
    mins = []
    for j in range(8):
        m = sc[:, :, j + 4] & 63 if j < 4 else (sc[:, :, j + 4] >> 4) | ((sc[:, :, j] >> 6) << 4)
        mins.append(m)
    return (dmin * torch.stack(mins, -1).double()).reshape(w.out_features, -1)   # [rows, blocks of 32]


@pytest.mark.parametrize("qtype", sorted(K_SUPER_BYTES))
def test_k_quant_kernel_computes_its_definition(qtype):
    """Q2_K / Q3_K / Q4_K / Q5_K / Q6_K repacked into the int8 kernel's 3-D layout: dequantizing and
    embedding give gguf's weights, and the matmul is the two-term int8 activations times the exact
    weights (Q4_K's and Q5_K's minima times the exact block sums of x; Q6_K's zero of 32 and Q3_K's of 4
    per 16 weights in integers; Q2_K's minima per 16 weights times the int8 terms' sums)."""
    w, dense = _random_k(qtype, 48, 512, seed=5)
    r = w.for_int8()
    assert r.x16 and r.data.dim() == 3 and r.out_features == 48
    assert r.data.numel() <= {"Q2_K": 1.0, "Q3_K": 1.04, "Q4_K": 1.03, "Q5_K": 1.025, "Q6_K": 1.0}[qtype] * w.data.numel()
    torch.testing.assert_close(KERNELS.qdequant(r.data, 512, torch.float32), dense, rtol=1e-6, atol=1e-7)
    ids = torch.tensor([[3, 0], [47, 17]])
    torch.testing.assert_close(KERNELS.qembedding(r.data, ids, 512, torch.float32), dense[ids.view(-1)],
                               rtol=1e-6, atol=1e-7)
    g = torch.Generator().manual_seed(2)
    bias = torch.randn(48, generator=g)
    for tokens in (1, 3, 8, 11):
        x = torch.randn(tokens, 512, generator=g)
        x[0, 32:64] = 0   # an all-zero block: scale 0
        if qtype in ("Q4_K", "Q5_K"):
            mins = _k_mins(w)   # dense = scale * code - min: the int8 terms multiply scale * code
            xb = x.double().view(tokens, -1, BLOCK)
            want = _int8_reference(x, w, dense + mins.float().repeat_interleave(BLOCK, 1), plain=True) \
                - xb.sum(-1) @ mins.T
        else:
            want = _int8_reference(x, w, dense, plain=True)
        got = KERNELS.qgemv(x, r.data, bias).double() - bias.double()
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        exact = x.double() @ dense.double().T
        assert (got - exact).abs().max() <= 1e-4 * exact.abs().max()
    x16 = torch.randn(3, 512, generator=g).bfloat16()   # bf16 activations: widened, the same arithmetic
    torch.testing.assert_close(KERNELS.qgemv(x16, r.data, None).float(),
                               KERNELS.qgemv(x16.float(), r.data, None), rtol=1e-2, atol=1e-2)


def test_kernels_refuse_what_they_cannot_read():
    w, _ = _quantized("Q8_0", 4, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        KERNELS.qgemv(torch.randn(1, 48), w.data[:, :51].contiguous(), None)
    with pytest.raises(RuntimeError, match="block size"):
        KERNELS.qgemv(torch.randn(1, 64), w.data[:, :60].contiguous(), None)   # 30 bytes per block: no such type
    with pytest.raises(RuntimeError, match="uint8"):
        KERNELS.qgemv(torch.randn(1, 64), w.data.float(), None)   # not blocks of bytes


def test_quant_linear_goes_dense_above_its_threshold():
    w, dense = _quantized("Q4_1", 64, 64, seed=3)
    g = torch.Generator().manual_seed(2)
    bias = torch.nn.Parameter(torch.randn(64, generator=g), requires_grad=False)
    x = torch.randn(20, 64, generator=g)
    want = torch.nn.functional.linear(x, dense, bias)
    # 0: the quantized kernel at every size; 16: dense from 16 tokens, widened per call or held
    for layer in (QuantLinear(w, bias, 0), QuantLinear(w, bias, 16), QuantLinear(w, bias, 16, dense_module(w, torch.float32))):
        torch.testing.assert_close(layer.forward(x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.forward(x[:3]), want[:3], rtol=1e-5, atol=1e-5)
    assert not any(n.endswith("bias") for n in dict(layer.dense.named_parameters()))   # the copy holds no bias


def _quantizing(type_of):
    """A GGUF writer hook storing each 2-D tensor in the type `type_of(name)` gives (None: as is)."""
    def add_tensor(writer, name, a):
        qtype = type_of(name) if a.ndim == 2 else None
        if qtype is None:
            writer.add_tensor(name, a)
            return
        kind = gguf.GGMLQuantizationType[qtype]
        data = gguf.quants.quantize(a, kind)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
    return add_tensor


def _tiny_quantized_gguf(hf_model, path, arch: str, qtype: str):
    """The tiny model as a GGUF whose 2-D tensors (embeddings too) are stored in `qtype`."""
    return _write_tiny_gguf(hf_model, path, arch, add_tensor=_quantizing(lambda name: qtype))


@pytest.mark.parametrize("name, arch, qtype", [("llama_gqa", "llama", "Q4_1"), ("llama_tied", "llama", "Q8_0"),
                                               ("qwen3", "qwen3", "Q4_0"), ("llama_gqa", "llama", "Q5_1")])
def test_quantized_model_equals_the_dequantized_one(tiny_models, tmp_path, monkeypatch, name, arch, qtype):
    """Q/K rows unpermuted as blocks, q/k/v and gate/up fused as blocks, quantized embeddings and
    LM head (tied or not): the same logits as the model dequantized at load, prefill and decode
    (the fused C++ layer loop included), and no fp32 copy of the weights in the cache."""
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    path = _tiny_quantized_gguf(tiny_models(name).hf, tmp_path / f"{name}.gguf", arch, qtype)
    meta = convert_gguf(path, weights=False)
    assert not (meta / "model.safetensors").exists()
    cfg = read_config(meta)
    weights = gguf_native_weights(path, cfg, (qtype,))
    assert {type(w) for k, w in weights.items() if k.endswith("proj.weight")} == {QuantTensor}
    quant = build_model(cfg, weights, int8_activations=False)
    dense = build_model(cfg, load_weights(convert_gguf(path)))
    assert any(isinstance(m, QuantLinear) for m in quant.modules())
    assert isinstance(quant.cpu_lm_head, QuantLinear)
    assert not any(isinstance(m, QuantLinear) for m in dense.modules())
    prompts = random_prompts([1, 9, 40], seed=5)
    for got, want in zip(conveyor_prompt_logits(quant, prompts, chunk=16),
                         conveyor_prompt_logits(dense, prompts, chunk=16)):
        torch.testing.assert_close(got, want, rtol=0, atol=logit_atol(want))
    assert quant.fused_decode_tokens > 0
    got, want = conveyor_greedy(quant, prompts, 12), conveyor_greedy(dense, prompts, 12)
    for i in range(len(prompts)):
        assert got.tokens[i] == want.tokens[i]
        torch.testing.assert_close(got.logits[i], want.logits[i], rtol=0, atol=logit_atol(want.logits[i]))


def test_fused_matmul_with_mixed_types_stays_dense(tiny_models, tmp_path, monkeypatch):
    """A fused matmul whose pieces are stored in different types (q/k in Q8_0, v in F32) is
    dequantized whole; the other layers' matmuls stay quantized."""
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    add_tensor = _quantizing(lambda name: None if "attn_v" in name else "Q8_0")
    path = _write_tiny_gguf(tiny_models("llama_gqa").hf, tmp_path / "mixed.gguf", "llama", add_tensor=add_tensor)
    cfg = read_config(convert_gguf(path, weights=False))
    model = build_model(cfg, gguf_native_weights(path, cfg, ("Q8_0",)), int8_activations=False)
    layer = model.layers[0]
    assert not isinstance(layer.self_attn.qkv_proj, QuantLinear)
    assert isinstance(layer.self_attn.o_proj, QuantLinear) and isinstance(layer.mlp.gate_up_proj, QuantLinear)
    dense = build_model(cfg, load_weights(convert_gguf(path)))
    prompts = random_prompts([7, 20], seed=6)
    for got, want in zip(conveyor_prompt_logits(model, prompts), conveyor_prompt_logits(dense, prompts)):
        torch.testing.assert_close(got, want, rtol=0, atol=logit_atol(want))


@pytest.mark.parametrize("int8,threads", [(False, 1), (True, 1), (True, 2)])
def test_fused_matmul_with_two_quantized_types_stays_quantized(tiny_models, tmp_path, monkeypatch, int8, threads):
    """Pieces quantized in different types (q/k in Q5_0, v in Q8_0, as Gemma 3's Q4_K_M file stores
    them) stay as stored, one kernel call per type (QuantConcat), and give the dequantized model's
    logits (int8 activations: close to them), through the fused decode loop too (its q/k/v in pieces;
    with two threads each quantizes the activations for itself and computes its share of the rows)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _two_quantized_types(tiny_models, tmp_path, monkeypatch, int8)
    finally:
        torch.set_num_threads(prev)


def _two_quantized_types(tiny_models, tmp_path, monkeypatch, int8):
    from conveyor.model.quant import QuantConcat

    if int8 and not KERNELS.quant_int8_native():
        pytest.skip("no AVX512-VNNI here")
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    add_tensor = _quantizing(lambda name: "Q8_0" if "attn_v" in name else "Q5_0")
    path = _write_tiny_gguf(tiny_models("qwen2").hf, tmp_path / "two.gguf", "qwen2", add_tensor=add_tensor)
    cfg = read_config(convert_gguf(path, weights=False))
    model = build_model(cfg, gguf_native_weights(path, cfg, ("Q5_0", "Q8_0")), int8_activations=int8)
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantConcat) and [p.qtype for p in qkv.parts] == ["Q5_0", "Q8_0"]
    assert qkv.bias is not None and qkv.bias.abs().sum() > 0   # Qwen2's q/k/v biases, added once
    assert isinstance(model.layers[0].mlp.gate_up_proj, QuantLinear) and model.fused_decode_tokens > 0
    dense = build_model(cfg, load_weights(convert_gguf(path)))
    prompts = random_prompts([7, 20], seed=6)
    for got, want in zip(conveyor_prompt_logits(model, prompts), conveyor_prompt_logits(dense, prompts)):
        torch.testing.assert_close(got, want, rtol=0, atol=(30 if int8 else 1) * logit_atol(want))
    calls, original = [], model._fused_decode
    monkeypatch.setattr(model, "_fused_decode", lambda *a: calls.append(1) or original(*a))
    fused = conveyor_greedy(model, prompts, 8)
    assert calls
    if not int8:
        assert fused.tokens == conveyor_greedy(dense, prompts, 8).tokens
    width, model.fused_decode_tokens = model.fused_decode_tokens, 0   # the Python layer loop: the same bits
    loop = conveyor_greedy(model, prompts, 8)
    model.fused_decode_tokens = width
    assert fused.tokens == loop.tokens
    assert all(torch.equal(a, b) for a, b in zip(fused.logits, loop.logits))


@pytest.mark.skipif(KERNELS is None or not KERNELS.quant_int8_native(), reason="no AVX512-VNNI here")
def test_int8_activation_model_stays_close_to_the_dequantized_one(tiny_models, tmp_path, monkeypatch):
    """The default on VNNI CPUs: every matmul (and the tied head) in the interleaved layout, the
    same bytes as the file; logits within 1e-3 of the scale of the dequantized model's, through
    prefill and the fused decode loop."""
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    path = _tiny_quantized_gguf(tiny_models("llama_tied").hf, tmp_path / "t.gguf", "llama", "Q8_0")
    cfg = read_config(convert_gguf(path, weights=False))
    model = build_model(cfg, gguf_native_weights(path, cfg, ("Q8_0",)))
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert linears and all(m.x16 for m in linears) and model.embed_tokens.x16
    assert model.cpu_lm_head.qweight is model.embed_tokens.qweight   # one copy for lookup and head
    dense = build_model(cfg, load_weights(convert_gguf(path)))
    prompts = random_prompts([1, 9, 40], seed=7)
    for got, want in zip(conveyor_prompt_logits(model, prompts, chunk=16),
                         conveyor_prompt_logits(dense, prompts, chunk=16)):
        assert (got - want).abs().max() <= 1e-3 * want.abs().max()
    assert model.fused_decode_tokens > 0
    got, want = conveyor_greedy(model, prompts, 8), conveyor_greedy(dense, prompts, 8)
    for i in range(len(prompts)):   # up to the first differing token (after it the contexts differ)
        n = next((j for j, (a, b) in enumerate(zip(got.tokens[i], want.tokens[i])) if a != b), 7) + 1
        assert (got.logits[i][:n] - want.logits[i][:n]).abs().max() <= 1e-3 * want.logits[i][:n].abs().max()


@pytest.mark.skipif(KERNELS is None or not KERNELS.quant_int8_native(), reason="no AVX512-VNNI here")
@pytest.mark.parametrize("qtype, dtype", [("Q4_1", torch.float32), ("Q8_0", torch.bfloat16)])
def test_the_fused_loop_runs_int8_steps_of_up_to_15_tokens_with_the_python_loops_bits(tiny_models, tmp_path,
                                                                                     monkeypatch, qtype, dtype):
    """Decode steps of 9-15 tokens on int8-layout weights take the fused C++ layer loop (two kernel
    passes per group of rows) and give the Python layer loop's logits to the bit."""
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    path = _tiny_quantized_gguf(tiny_models("llama_gqa").hf, tmp_path / "t.gguf", "llama", qtype)
    cfg = read_config(convert_gguf(path, weights=False))
    model = build_model(cfg, gguf_native_weights(path, cfg, (qtype,)), dtype=dtype, int8_activations=True)
    assert all(m.x16 for m in model.modules() if isinstance(m, QuantLinear))
    assert model.fused_decode_tokens == FUSED_INT8_TOKENS == 15
    prompts = random_prompts([3 + 2 * i for i in range(13)], seed=8)   # 13 sequences decoding together
    widths, original = [], model._fused_decode
    monkeypatch.setattr(model, "_fused_decode", lambda x, *a: widths.append(x.shape[0]) or original(x, *a))
    fused = conveyor_greedy(model, prompts, 6)
    assert max(widths) == 13   # the 13-token decode steps took the fused loop
    width, model.fused_decode_tokens = model.fused_decode_tokens, 0   # the Python layer loop
    loop = conveyor_greedy(model, prompts, 6)
    model.fused_decode_tokens = width
    assert fused.tokens == loop.tokens
    assert all(torch.equal(a, b) for a, b in zip(fused.logits, loop.logits))


@pytest.mark.parametrize("qtype", [pytest.param("Q4_0", marks=pytest.mark.heavy),
                                   pytest.param("Q4_K_M", marks=pytest.mark.heavy), "Q5_K_M", "Q3_K_M", "Q2_K_M"])
def test_a_synthetic_quantized_file_loads_and_holds_its_bytes(tmp_path, monkeypatch, qtype):
    """conveyor.bench.synthetic_gguf's files (random Q4_0 blocks, or Q4_K / Q5_K with Q6_K as
    llama.cpp mixes them in a Q4_K_M / Q5_K_M file, or Q3_K with Q4_K and Q6_K, or Q2_K with Q3_K and
    Q6_K, at a model's shapes,
    the demo tokenizer) load and generate, holding their matmul weights in about the file's bytes
    (K mixes: where int8 activations run), and K mixes give the
    logits of the same file dequantized."""
    from conveyor.model.loader import load_model
    from conveyor.model.quant import int8_activations_native

    k_mix = qtype.endswith("_K_M")
    if k_mix and not int8_activations_native():
        pytest.skip("K-quants are computed as stored only with int8 activations (AVX512-VNNI)")
    from conveyor import LLM, SamplingParams
    from conveyor.bench.synthetic_gguf import write
    from conveyor.model.loader import ModelNotFoundError, demo_model_path

    try:
        demo = demo_model_path()
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    path = write("tiny", qtype, tmp_path, demo)
    tensor_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)
    with LLM(str(path), dtype="float32", num_kv_blocks=32, cost_model="none") as llm:
        out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
        held = llm.engine.loaded.model.weight_bytes()
    assert len(out[0].outputs[0].token_ids) == 4
    assert held[qtype[:4]] > 0 and (not k_mix or held["Q6_K"] > 0)
    assert abs(sum(held.values()) - tensor_bytes) <= 0.1 * tensor_bytes
    if k_mix:   # every matmul as stored (int8 activations) vs the file dequantized to fp32
        stored, dense = load_model(path).model, load_model(path, quantization="none").model
        prompts = random_prompts([1, 9, 40], seed=3)
        for got, want in zip(conveyor_prompt_logits(stored, prompts, chunk=16),
                             conveyor_prompt_logits(dense, prompts, chunk=16)):
            assert (got - want).abs().max() <= 1e-3 * want.abs().max()


def test_auto_keeps_blocks_only_where_the_kernels_are_vectorized(monkeypatch):
    """Without AVX-512 and without the int8 kernel's vector paths (AVX512-VNNI or AVX2) the kernels
    are scalar loops: `auto` then dequantizes at load, while `weight-only` still asks for the blocks
    as stored. With the int8 kernel (an AVX2 CPU: tests/model/test_quant_avx2.py) they stay."""
    from conveyor.model import loader, probe_cache, quant
    from conveyor.model.loader import ModelNotFoundError, demo_model_path

    try:
        path = demo_model_path()
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    model, flags = probe_cache.cpu_info()
    if "avx512f" in flags or quant.int8_activations_native():
        assert loader._native_types(path, "cpu", torch.float32, None, True) == ("Q4_1", "Q8_0")
    monkeypatch.setattr(probe_cache, "cpu_info", lambda: (model, flags - {"avx512f"}))
    monkeypatch.setattr(quant, "int8_activations_native", lambda: True)   # AVX2
    assert loader._native_types(path, "cpu", torch.float32, None, True) == ("Q4_1", "Q8_0")
    monkeypatch.setattr(quant, "int8_activations_native", lambda: False)   # neither
    assert loader._native_types(path, "cpu", torch.float32, None, True) == ()
    assert loader._native_types(path, "cpu", torch.float32, None, False) == ("Q4_1", "Q8_0")
    assert loader._native_types(path, "cpu", torch.float32, object(), False) == ()   # tensor parallel


def test_bf16_models_take_the_int8_kernel_wherever_vnni_is(tiny_models, tmp_path, monkeypatch):
    """The kernel a model's 32-blocks use is a function of its dtype and the CPU's flags (never a
    timing): int8 for fp32 and bf16 wherever VNNI is, AMX or not (until 2026-12-05 AMX CPUs kept bf16
    models on the bf16-rounding kernel). On the int8 kernel a bf16 model holds the file's blocks
    only (no dense copy) and stays within bf16's rounding of the fp32 model's logits."""
    from conveyor.model import dtype as dtype_mod
    from conveyor.model import quant

    monkeypatch.setattr(quant, "int8_activations_native", lambda: True)
    for flags in ({"avx512f", "avx512_vnni", "avx512_bf16"}, {"avx512f", "avx512_vnni", "amx_tile", "amx_bf16"}):
        monkeypatch.setattr(dtype_mod, "cpu_flags", lambda f=flags: f)
        assert quant.int8_activations_for(torch.float32) and quant.int8_activations_for(torch.bfloat16)
        assert not quant.int8_activations_for(torch.float16)
    monkeypatch.setenv("CONVEYOR_QUANT_BF16", "bf16")   # the bf16-rounding kernel, for comparisons
    assert not quant.int8_activations_for(torch.bfloat16) and quant.int8_activations_for(torch.float32)
    monkeypatch.setattr(quant, "int8_activations_native", lambda: False)   # no VNNI: never
    monkeypatch.setenv("CONVEYOR_QUANT_BF16", "int8")
    assert not quant.int8_activations_for(torch.float32) and not quant.int8_activations_for(torch.bfloat16)
    monkeypatch.undo()

    if not quant.int8_activations_native():
        pytest.skip("no AVX512-VNNI here: the int8 kernel does not run")
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CONVEYOR_QUANT_DENSE_COPY", "on")   # would be held, were the bf16-rounding kernel used
    path = _tiny_quantized_gguf(tiny_models("llama_tied").hf, tmp_path / "t.gguf", "llama", "Q8_0")
    cfg = read_config(convert_gguf(path, weights=False))
    model = build_model(cfg, gguf_native_weights(path, cfg, ("Q8_0",)), dtype=torch.bfloat16)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert linears and all(m.x16 and m.dense_from == 0 and m.dense is None for m in linears)
    assert set(model.weight_bytes()) == {"Q8_0", "bfloat16"}   # the blocks and the norms: no dense copy
    dense = build_model(cfg, load_weights(convert_gguf(path)))
    prompts = random_prompts([1, 9, 40], seed=7)
    for got, want in zip(conveyor_prompt_logits(model, prompts, chunk=16),
                         conveyor_prompt_logits(dense, prompts, chunk=16)):
        assert (got.float() - want).abs().max() <= 3e-2 * want.abs().max()   # bf16 activations
