"""GGUF-quantized weights computed as stored (``--quantization auto``, the default for GGUF files).

A Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 tensor stays in its blocks of 32 weights (``QuantTensor``: the file's bytes,
one row of blocks per output feature) and matmuls read it through the C++ kernels
(csrc/quant_cpu.cpp): a decode step streams 0.56-1.06 bytes per weight instead of 2 (bf16) or 4
(fp32). Which kernel, by the activations' dtype (docs/models.md):

- fp32 and bf16 on CPUs with AVX512-VNNI or AVX2 (``int8_activations_for``; AVX2's path gives
  VNNI's bits): the blocks
  reordered once into 16-row groups (``for_int8``, the same bytes) and int8 dot products, the
  activations split per block into two int8 terms; every step size, so a token's numbers do not
  depend on its batch (on AMX-INT8 CPUs steps of 16+ tokens multiply 32-blocks on AMX tiles, the
  same integers and bits: ``int8_amx_tokens``);
- bf16 without VNNI, with ``CONVEYOR_QUANT_BF16=bf16``, or ``weight-only``: each block rounded to
  bf16 (the dequantized bf16 model's weights) and bf16 dot products; above a token count measured
  per shape (``dense_tokens``) a dense bf16 copy (``dense_module``, held when it fits
  ``DENSE_COPY_MEMORY_SHARE`` of memory) or a weight widened per call;
- otherwise (``weight-only``, fp32 without VNNI): each block widened to fp32, FMAs.

K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) stay as stored only where the int8 kernel runs (AVX512-VNNI, AVX2),
for fp32 and bf16 models. Other GGUF types (F16, IQ types, ...) are dequantized at load as with
``--quantization none``, which dequantizes everything to ``--dtype`` (the pre-existing path, cached
on disk).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import cache

import gguf
import torch
import torch.nn.functional as F
from torch import nn

from conveyor.model import linear
from conveyor.model.cpu_kernels import cpu_kernels, load_cpu_kernels
from conveyor.model.probe_cache import remembered

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("auto", "weight-only", "none")   # what load_model takes (config.py lists them for the CLI)
NATIVE_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}   # bytes per block of 32 weights
BLOCK = 32
# K-quants: bytes per super-block of 256 weights. Computed as stored only with int8 activations (the
# x16 layout, AVX512-VNNI or AVX2); elsewhere they are dequantized at load.
K_SUPER_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
SUPER = 256


def int8_activations_native() -> bool:
    """Whether the int8-activation kernel runs on int8 dot products here (AVX512-VNNI, or AVX2's
    vpmaddubsw with the same integer sums and bits): a CPU feature, so the same command always
    chooses the same numerics on a machine."""
    kernels = _kernels()
    return kernels is not None and bool(kernels.quant_int8_native())


# Decode steps of up to this many tokens on int8-layout weights run in the fused layer loop (one
# C++ call for all layers): below the 16 tokens from which the int8 kernel may take AMX tiles,
# which the loop's threads do not run. Above 8 tokens the kernel makes two passes (8 + the rest)
# per group of 16 rows; the second reads the group's few KB from L1. Measured on the AMX Xeon
# (demo model, bf16, 256 tokens of context): 9-15 tokens 3.3-4.0 ms a step faster than the Python
# layer loop (16.4 vs 19.9 ms at 9, 22.7 vs 26.7 at 15; docs/performance.md).
FUSED_INT8_TOKENS = 15


def int8_amx_tokens() -> int:
    """The fewest tokens of a step for which the int8 kernel computes 32-blocks (Q4_0, Q4_1, Q5_0, Q5_1,
    Q8_0) on AMX tiles here, 0 where it never does (no AMX-INT8, a compiler without it, or
    ``CONVEYOR_INT8_AMX=off``). Each token's outputs are the VNNI path's to the bit, so this changes
    speed only; whole tiles of 16 tokens take AMX, a step's remaining tokens VNNI."""
    kernels = _kernels()
    return int(kernels.int8_amx_tokens()) if kernels is not None and kernels.int8_amx() else 0


def int8_activations_for(dtype: torch.dtype) -> bool:
    """Whether a model in `dtype` multiplies its quantized 32-blocks with int8 activations (the int8
    kernel at every step size), by CPU features only, so a restart never changes the numbers: fp32
    and bf16 wherever the CPU has int8 dot products (AVX512-VNNI, AVX2).

    bf16 on AMX CPUs took the bf16-rounding kernel (weights rounded to bf16) with a dense bf16 copy
    for large steps until 2026-12-05; measured there on the demo model (docs/models.md): the int8
    kernel's batch-1 step 2.8x shorter (3.3 vs 9.3 ms), but the reference workload at 0.6-0.65x the
    dense bf16 model's throughput (oneDNN's AMX tiles win large steps, which the old path ran on its
    dense copy), 92 instead of 348 MiB of weights, and one kernel at every step size, which makes
    the model batch-invariant (``row_invariant_matmuls``).
    ``CONVEYOR_QUANT_BF16=bf16`` keeps the bf16-rounding kernel, for comparisons (``int8``: the default)."""
    if not int8_activations_native():
        return False
    if dtype == torch.float32:
        return True
    if dtype != torch.bfloat16:
        return False
    return os.environ.get("CONVEYOR_QUANT_BF16", "auto") != "bf16"


def row_invariant_matmuls(model: nn.Module) -> bool:
    """Whether every matmul of `model` (its layers' and the LM head) gives each row the numbers it
    gets alone: all are QuantLinears on the int8 kernel, which serves every step size with one
    order of sums per row. Dense matmuls are not (oneDNN and the GEMV block by the step's size)."""
    if getattr(model, "tp", None) is not None:
        return False
    linears = [m for m in model.layers.modules() if isinstance(m, (nn.Linear, linear.CpuLinear, QuantLinear))]
    head = getattr(model, "cpu_lm_head", None)
    return bool(linears) and all(isinstance(m, QuantLinear) and m.x16 and not m.dense_from
                                 for m in [*linears, head])


@dataclass(slots=True)
class QuantTensor:
    """A 2-D weight [out_features, in_features] as GGUF blocks: ``data`` uint8 [out, row bytes]."""
    data: torch.Tensor
    qtype: str
    in_features: int

    @property
    def out_features(self) -> int:
        return self.data.shape[0] * (16 if self.x16 else 1)

    @property
    def is_k(self) -> bool:
        return self.qtype in K_SUPER_BYTES

    @staticmethod
    def cat(pieces: list[QuantTensor]) -> QuantTensor:
        """Row-wise concatenation (q/k/v, gate/up): rows of blocks are independent."""
        first = pieces[0]
        assert all(p.qtype == first.qtype and p.in_features == first.in_features and not p.x16 for p in pieces)
        return QuantTensor(torch.cat([p.data for p in pieces]), first.qtype, first.in_features)

    @property
    def x16(self) -> bool:
        """In the int8 kernel's interleaved layout (csrc/quant_cpu.cpp), not the file's (K-quants: 3-D)."""
        if self.is_k:
            return self.data.dim() == 3
        return self.data.shape[1] == 16 * (self.in_features // BLOCK) * NATIVE_BLOCK_BYTES[self.qtype]

    def for_int8(self) -> QuantTensor:
        """This weight in the int8 kernel's layout (16 rows interleaved, the same bytes), when its
        rows come in 16s; else itself (the fp32-activation kernel serves it)."""
        if self.x16 or self.data.shape[0] % 16:
            return self
        if self.is_k:
            data = _kernels().krepack(self.data, self.in_features, K_SUPER_BYTES[self.qtype])
        else:
            data = _kernels().qrepack(self.data, self.in_features)
        return QuantTensor(data, self.qtype, self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        kernels = _kernels()
        if kernels is not None and (self.x16 or not self.is_k):   # the kernels read plain K-quants only repacked
            return kernels.qdequant(self.data, self.in_features, dtype)
        data = gguf.quants.dequantize(self.data.numpy(), gguf.GGMLQuantizationType[self.qtype])
        return torch.from_numpy(data).to(dtype)


def _kernels():
    return load_cpu_kernels()


def native_available(device: str | torch.device, dtype: torch.dtype) -> bool:
    """Whether quantized matmuls can run here: CPU, fp32 or bf16 activations, the C++ kernels built."""
    return cpu_kernels(device, dtype) is not None


# The quantized kernel is kept up to the largest probed token count where it takes at most this
# much of the dense path's time; above, the dense path.
DENSE_PROBE_TOKENS = (16, 32, 64, 128, 256)
DENSE_MARGIN = 1.1
# A dense copy of the quantized matmuls (for large steps) is kept only while it takes at most this
# share of the machine's memory: the demo model's bf16 copy (257 MiB) pays 1.8x on the reference
# workload (784 vs 425 tok/s widening per call); an 8B model's (16 GB) would not fit beside it.
DENSE_COPY_MEMORY_SHARE = 0.25


def dense_copy_allowed(dense_bytes: int) -> bool:
    """Whether the quantized matmuls may also hold a dense copy for large steps (prefill chunks,
    big decode batches): by its size against the machine's memory (``CONVEYOR_QUANT_DENSE_COPY=
    on|off`` overrides). Without it those steps widen the weight on every call, or stay quantized."""
    forced = os.environ.get("CONVEYOR_QUANT_DENSE_COPY", "auto")
    if forced in ("on", "off"):
        return forced == "on"
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return False
    return dense_bytes <= DENSE_COPY_MEMORY_SHARE * total


@cache
def dense_tokens(dtype: torch.dtype, qtype: str, in_features: int, out_features: int, copy: bool = False) -> int:
    """From how many tokens a matmul on this quantized shape runs dense (on a held dense copy when
    `copy`, prepacked where that pays, else widening the weight on each call); 0: never. Measured
    once per machine (interleaved, a margin) and remembered; ``CONVEYOR_QUANT_DENSE=never|always``
    overrides, for comparisons."""
    forced = os.environ.get("CONVEYOR_QUANT_DENSE", "auto")
    if forced == "never":
        return 0
    if forced == "always":
        return 1
    name = f"quant_dense_tokens/{dtype}/{qtype}{'/copy' if copy else ''}/{in_features}x{out_features}"
    return int(remembered(name, lambda: _measure_dense(dtype, qtype, in_features, out_features, copy)))


def dense_module(weight: QuantTensor, dtype: torch.dtype) -> nn.Module:
    """The held dense copy (no bias: the QuantLinear adds its own): a CpuLinear on oneDNN's
    prepacked layout where that is faster for this shape, else on the plain weight (F.linear);
    never the GEMV (small steps stay quantized)."""
    packed = linear.prefer_packed("cpu", dtype, weight.in_features, weight.out_features)
    return linear.CpuLinear(weight.dequantize(dtype), None, packed, 0)


def _random_quant(qtype: str, in_features: int, out_features: int) -> QuantTensor:
    """Random codes with small fp16 scales (and minima): what the kernels see in a real file."""
    nb, bs = in_features // BLOCK, NATIVE_BLOCK_BYTES[qtype]
    data = torch.randint(0, 256, (out_features, nb, bs), dtype=torch.uint8)
    header = 4 if qtype == "Q4_1" else 2
    scales = (torch.rand(out_features, nb, header // 2) * 0.02).half().view(torch.uint8).view(out_features, nb, header)
    data[:, :, :header] = scales
    return QuantTensor(data.view(out_features, nb * bs).contiguous(), qtype, in_features)


def _measure_dense(dtype: torch.dtype, qtype: str, in_features: int, out_features: int, copy: bool) -> int:
    kernels = _kernels()
    if kernels is None:
        return 1
    qt = _random_quant(qtype, in_features, out_features)
    if copy:
        held = dense_module(qt, dtype)
        dense = held.forward
    else:
        dense = lambda x: F.linear(x, kernels.qdequant(qt.data, in_features, dtype))  # noqa: E731
    ratios, chosen = {}, 0
    for tokens in DENSE_PROBE_TOKENS:
        x = torch.randn(tokens, in_features, dtype=dtype)
        ratios[tokens] = linear._ratio(lambda: kernels.qgemv(x, qt.data, None), lambda: dense(x))
    # The first count from which the dense path wins at every larger one.
    for tokens in reversed(DENSE_PROBE_TOKENS):
        if ratios[tokens] <= DENSE_MARGIN:
            break
        chosen = tokens
    logger.info("quantized %s matmul %dx%d for %s: dense%s from %s tokens (time vs dense: %s)", qtype,
                in_features, out_features, dtype, " copy" if copy else "", chosen or "never",
                ", ".join(f"{t}: {r:.2f}x" for t, r in ratios.items()))
    return chosen


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W a QuantTensor: the quantized kernel up to ``dense_from`` - 1 tokens
    (any count when 0), a dense weight above: the held copy `dense` (a CpuLinear), or one widened
    for the call."""

    def __init__(self, weight: QuantTensor, bias: nn.Parameter | None, dense_from: int = 0,
                 dense: nn.Module | None = None):
        super().__init__()
        self.dense = dense
        self.in_features, self.out_features, self.qtype = weight.in_features, weight.out_features, weight.qtype
        self.x16 = weight.x16   # int8 activations (the interleaved layout), else fp32 / bf16
        self.register_buffer("qweight", weight.data, persistent=False)
        self.bias = bias
        self.dense_from = dense_from
        self.kernels = _kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense_from and x.shape[0] >= self.dense_from:
            if self.dense is not None:
                y = self.dense.forward(x)
                return y if self.bias is None else y.add_(self.bias)
            return F.linear(x, self.kernels.qdequant(self.qweight, self.in_features, x.dtype), self.bias)
        return self.kernels.qgemv(x, self.qweight, self.bias)

    def fused_width(self) -> int:
        """Up to how many tokens the fused decode loop (csrc/decode_layers_cpu.cpp) may run this
        matmul: one pass of the quantized kernel, below the count where it goes dense; in the
        interleaved (int8) layout up to FUSED_INT8_TOKENS, in passes of 8 whose second pass over a
        group of 16 rows finds its bytes still in L1."""
        if self.x16 and not self.dense_from:
            return FUSED_INT8_TOKENS
        most = linear.MAX_GEMV_TOKENS
        return most if not self.dense_from else min(most, self.dense_from - 1)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.qtype}, int8={self.x16}, dense_from={self.dense_from}"


class QuantConcat(nn.Module):
    """A fused matmul (q/k/v, gate/up) whose pieces are stored in different GGUF types (Gemma 3's
    q and k in Q5_0, v in Q8_0): one QuantLinear per run of pieces of one type, their outputs side
    by side, the fused bias (HF's pieces' biases, concatenated) added once."""

    def __init__(self, parts: list[QuantLinear], bias: nn.Parameter | None):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.bias = bias
        self.in_features, self.out_features = parts[0].in_features, sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([p.forward(x) for p in self.parts], dim=-1)
        return y if self.bias is None else y.add_(self.bias)


class QuantEmbedding(nn.Module):
    """Token embeddings from a quantized table: only the looked-up rows are widened."""

    def __init__(self, weight: QuantTensor, dtype: torch.dtype):
        super().__init__()
        self.embedding_dim, self.num_embeddings, self.qtype = weight.in_features, weight.out_features, weight.qtype
        self.x16 = weight.x16
        self.register_buffer("qweight", weight.data, persistent=False)
        self.dtype = dtype
        self.kernels = _kernels()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.kernels.qembedding(self.qweight, ids, self.embedding_dim, self.dtype).view(
            *ids.shape, self.embedding_dim)

