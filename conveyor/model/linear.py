"""CPU linear layers dispatched by the step's token count, each path chosen by measurement.

- **A few tokens** (a decode step of small batch, up to 8): the C++ GEMV (csrc/gemv_cpu.cpp)
  streams the plain row-major weight once with AVX512-BF16 dot products (bf16) or FMAs (fp32).
  Such a matmul is bound by reading the weight; oneDNN adds ~15-20 us of fixed cost per call
  (at batch 1 a third of the step over the ~120 matmuls of the demo model), and MKL's fp32
  matmul at 4-8 rows reads the weight about twice as slowly.
- **More tokens:** oneDNN prepacked weights, per weight shape where measured faster.
  ``torch.ops.mkldnn._reorder_linear_weight`` lays a weight out once in oneDNN's blocked format
  (AMX tiles where the CPU has them);
  ``_linear_pointwise`` then multiplies without repacking it on every call — the part that
  dominates small-batch matmuls. It pays for bf16 on AMX CPUs (1.5-2x at decode batch sizes);
  for fp32 it is about even.
- **Otherwise** ``F.linear``.

Both choices are measured on the model's own shapes (prepacking per shape, at the token counts
it would serve; the GEMV on the largest layer shape, streaming from memory), interleaved, with a
margin, and remembered per machine (probe_cache.py), since the CPUs of these machines vary. When
both apply, the layer holds its weight twice (plain for the GEMV, packed for the rest): one more
copy of the layer weights in memory, none more read per step.
``CONVEYOR_PACKED_LINEAR=off`` and ``CONVEYOR_GEMV=off`` turn either off, for comparisons.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.model.cpu_kernels import cpu_kernels, load_cpu_kernels
from conveyor.model.probe_cache import remembered

logger = logging.getLogger(__name__)

MAX_GEMV_TOKENS = 8   # the kernel's widest pass over the weight (more tokens would read it again)


def _ops_available() -> bool:
    return hasattr(torch.ops, "mkldnn") and hasattr(torch.ops.mkldnn, "_linear_pointwise") \
        and torch.backends.mkldnn.is_available()


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _time(fn, repeats: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t) / repeats


def _ratio(a, b, rounds: int = 5) -> float:
    """Median over `rounds` of time(a) / time(b), each round timing both once, in alternating
    order (a drift in the machine's speed hits both sides), after one warm call of each."""
    a(), b()
    ratios = []
    for r in range(rounds):
        if r % 2:
            tb, ta = _time(b, 1, 0), _time(a, 1, 0)
        else:
            ta, tb = _time(a, 1, 0), _time(b, 1, 0)
        ratios.append(ta / tb)
    return statistics.median(ratios)


# Token counts a prepacked weight is timed at: the steps that do not go to the GEMV (decode
# batches, prefill chunks). The LM head only sees the rows being sampled (<= max_num_seqs).
PACKED_PROBE_TOKENS = (16, 64, 256)
PACKED_PROBE_TOKENS_HEAD = (16, 64)
PACKED_MARGIN = 0.95   # prepacking must be clearly faster: F.linear is the default and needs no copy


@cache
def _measured(dtype: torch.dtype, in_features: int, out_features: int) -> bool:
    return bool(remembered(f"packed_linear/{dtype}/{in_features}x{out_features}",
                           lambda: _measure_packed(dtype, in_features, out_features)))


def _measure_packed(dtype: torch.dtype, in_features: int, out_features: int) -> bool:
    """Prepacked oneDNN against F.linear on this shape at the token counts it would serve (the
    sum over them, so each count weighs by its cost), interleaved rounds, a 5% margin. On AMD
    CPUs MKL's fp32 matmul runs at about half the rate of oneDNN's (an EPYC Zen5: 230 vs 493
    GFLOP/s on 2048^3; benchmarks/gemm_shapes.py), while at one token oneDNN's fixed cost can
    lose: so one token, which the GEMV serves anyway, is not what decides."""
    if not _ops_available():
        return False
    try:
        w = torch.randn(out_features, in_features, dtype=dtype)
        pw = pack(w)
        tokens = PACKED_PROBE_TOKENS_HEAD if out_features > 16 * in_features else PACKED_PROBE_TOKENS
        xs = [torch.randn(t, in_features, dtype=dtype) for t in tokens]
        for x in xs:
            if not torch.allclose(packed_linear(x, pw, None).float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-1):
                logger.warning("prepacked oneDNN linear disagrees with F.linear for %s; not used", dtype)
                return False
        ratio = _ratio(lambda: [packed_linear(x, pw, None) for x in xs], lambda: [F.linear(x, w) for x in xs])
        ok = ratio < PACKED_MARGIN
        logger.info("prepacked oneDNN linear for %s %dx%d: %.2fx F.linear's time, %s", dtype, in_features,
                    out_features, ratio, "used" if ok else "not used")
        return ok
    except Exception as e:   # noqa: BLE001 - an op missing or refusing this dtype: plain F.linear
        logger.info("prepacked oneDNN linear unavailable for %s: %s", dtype, e)
        return False


def prefer_packed(device: torch.device | str, dtype: torch.dtype, in_features: int, out_features: int) -> bool:
    """Use prepacked weights for this dtype? (CPU only; measured once per process and shape;
    CONVEYOR_PACKED_LINEAR=off turns them off, for comparisons.)"""
    if os.environ.get("CONVEYOR_PACKED_LINEAR", "auto") == "off":
        return False
    return torch.device(device).type == "cpu" and _measured(dtype, in_features, out_features)


@cache
def _gemv_measured(dtype: torch.dtype, in_features: int, out_features: int, packed: bool, copies: int) -> int:
    if cpu_kernels("cpu", dtype) is None:   # not built here: nothing to remember
        return 0
    name = f"gemv_tokens/{dtype}/{in_features}x{out_features}/{'packed' if packed else 'plain'}/{copies}"
    return int(remembered(name, lambda: _measure_gemv(dtype, in_features, out_features, packed, copies)))


# The GEMV is used up to the largest token count where its matmul takes at most this much of the
# other path's time: within the threshold a decode step also runs all its layers in one C++ call,
# which saves 10-25% of a small step (bf16, EPYC Zen5, batch 1-8: 9.1-11.2 ms against 11.1-12.7 ms
# with the GEMV and oneDNN at 0.9-1.1x each other), so a tie goes to the GEMV.
GEMV_MARGIN = 1.15


def _measure_gemv(dtype: torch.dtype, in_features: int, out_features: int, packed: bool, copies: int) -> int:
    kernels = cpu_kernels("cpu", dtype)
    if kernels is None:
        return 0
    ws = [torch.randn(out_features, in_features, dtype=dtype) for _ in range(copies)]
    pws = [pack(w) for w in ws] if packed else ws
    other = (lambda x, w: packed_linear(x, w, None)) if packed else (lambda x, w: F.linear(x, w))
    best, ratios = 0, {}
    for tokens in range(1, MAX_GEMV_TOKENS + 1):
        x = torch.randn(tokens, in_features, dtype=dtype)
        if not torch.allclose(kernels.gemv(x, ws[0], None).float(), F.linear(x, ws[0]).float(), rtol=1e-2, atol=1e-1):
            logger.warning("C++ GEMV disagrees with F.linear for %s; not used", dtype)
            return 0
        # One pass over the copies each, alternating. Every count is measured (no stop at the first
        # loss: near a tie one noisy count would otherwise cut the threshold short).
        ratios[tokens] = _ratio(lambda: [kernels.gemv(x, w, None) for w in ws], lambda: [other(x, w) for w in pws])
        if ratios[tokens] <= GEMV_MARGIN:
            best = tokens
    logger.info("C++ GEMV for %s: used up to %d tokens per matmul (time vs the other path: %s)", dtype, best,
                ", ".join(f"{t}: {r:.2f}x" for t, r in ratios.items()))
    return best


def gemv_tokens(device: torch.device | str, dtype: torch.dtype, in_features: int, out_features: int,
                packed: bool, model_bytes: int) -> int:
    """Up to how many tokens the C++ GEMV is no slower than the other path (0: never); CPU only,
    measured once per process and shape; CONVEYOR_GEMV=off turns it off.

    It is timed over as many copies of the weight as make up the model's matmul weights
    (`model_bytes`), capped at 128 MiB: the regime a step runs in. A small model stays in cache,
    where MKL's fp32 GEMV is as fast; a real one streams from memory, where the prefetched
    GEMV wins (measured in fp32 at one token: 1.0x over 32 MiB, 0.74x over 128 MiB)."""
    if os.environ.get("CONVEYOR_GEMV", "auto") == "off" or torch.device(device).type != "cpu":
        return 0
    copies = max(2, min(model_bytes, 128 << 20) // (in_features * out_features * dtype.itemsize))
    return _gemv_measured(dtype, in_features, out_features, packed, copies)


PREFETCH_MARGIN = 0.97   # the hardware prefetchers alone must be clearly faster to drop the software one


def configure_gemv_prefetch(dtype: torch.dtype, weights: list[torch.Tensor]) -> bool:
    """Whether one-token GEMV passes issue software prefetches, measured on this machine over the
    model's own matmul weights (one batch-1 step's worth) and remembered, and set in the kernels
    (a process-wide switch; it changes speed, never a result). On the Xeon they paid (0.8x ->
    0.95x of the streaming bandwidth); on an EPYC Zen5 one-token passes ran 8-10% faster without
    them, while passes of 2+ tokens need them everywhere (they always prefetch)."""
    kernels = cpu_kernels("cpu", dtype)
    if kernels is None or not weights:
        return False
    total = sum(w.numel() for w in weights) * dtype.itemsize
    on = bool(remembered(f"gemv_prefetch_single/{dtype}/{len(weights)}x{total}",
                         lambda: _measure_gemv_prefetch(kernels, dtype, weights)))
    kernels.set_gemv_prefetch_single(on)
    return on


def _measure_gemv_prefetch(kernels, dtype: torch.dtype, weights: list[torch.Tensor]) -> bool:
    xs = {k: torch.randn(1, k, dtype=dtype) for k in {w.shape[1] for w in weights}}
    ws = [w.detach().contiguous() for w in weights]

    def run(prefetch: bool):
        def go():
            kernels.set_gemv_prefetch_single(prefetch)
            return [kernels.gemv(xs[w.shape[1]], w, None) for w in ws]
        return go

    ratio = _ratio(run(False), run(True), rounds=7)   # time without / time with
    kernels.set_gemv_prefetch_single(True)
    on = not ratio < PREFETCH_MARGIN
    logger.info("one-token GEMV passes for %s: %.2fx the time without software prefetch; prefetch %s",
                dtype, ratio, "on" if on else "off")
    return on


class CpuLinear(nn.Module):
    """An nn.Linear that runs a step of up to `gemv_max` tokens through the C++ GEMV on its plain
    weight, and larger steps through its oneDNN-prepacked weight (when `packed`) or F.linear.
    The plain weight is kept only if some path reads it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool, gemv_max: int):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = pack(weight) if packed else None
        self.weight = weight.detach() if gemv_max or not packed else None
        self.bias = bias
        self.gemv_max = gemv_max
        self.kernels = load_cpu_kernels() if gemv_max else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.gemv_max and x.dim() == 2 and x.is_contiguous():
            return self.kernels.gemv(x, self.weight, self.bias)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


def replace_linears(module: nn.Module, packed, gemv_max: int) -> int:
    """Replace every nn.Linear below `module` by a CpuLinear; returns how many. `packed`: a bool,
    or a function (in_features, out_features) -> bool choosing per weight shape."""
    choose = packed if callable(packed) else (lambda k, n: packed)
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, CpuLinear(child.weight, child.bias, choose(child.in_features, child.out_features),
                                            gemv_max))
            count += 1
        else:
            count += replace_linears(child, choose, gemv_max)
    return count
