"""``dtype="auto"``: the compute dtype this machine runs fastest, decided by measurement.

On CUDA: bf16 where the GPU supports it, else fp16. On a CPU: bf16 only if a bf16 matmul of a
decoder-sized shape, in the form the engine runs it (oneDNN prepacked where that is faster),
beats fp32 by a clear margin here — the case on CPUs with AMX or AVX512-BF16; without native
bf16 the emulation is slower than fp32 and the probe says so. Flags alone are not trusted: a
VM can report them while the hypervisor traps the instructions.
"""

from __future__ import annotations

import logging
import time
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# bf16 must be at least this much faster than fp32 to be picked (it costs precision).
MIN_SPEEDUP = 1.3


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _time(fn, repeats: int = 10) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@cache
def bf16_speedup_on_cpu() -> float:
    """fp32 time / bf16 time of a [32, 1024] x [1024, 2816] matmul (a decode step's batch, an MLP's shape)."""
    from conveyor.model.linear import _ops_available, pack, packed_linear

    x, w = torch.randn(32, 1024), torch.randn(2816, 1024)
    fp32 = _time(lambda: F.linear(x, w))
    xb, wb = x.bfloat16(), w.bfloat16()
    bf16 = _time(lambda: F.linear(xb, wb))
    if _ops_available():
        try:
            pw = pack(wb)
            bf16 = min(bf16, _time(lambda: packed_linear(xb, pw, None)))
        except Exception:   # noqa: BLE001 - no packed bf16 here: the plain matmul's time stands
            pass
    return fp32 / bf16


def resolve_dtype(spec: str, device: str | torch.device) -> str:
    """The dtype to run: `spec` itself, or for "auto" what this device runs best."""
    if spec != "auto":
        return spec
    if torch.device(device).type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    speedup = bf16_speedup_on_cpu()
    flags = sorted(cpu_flags() & {"amx_bf16", "avx512_bf16", "avx512f", "avx2"})
    chosen = "bfloat16" if speedup >= MIN_SPEEDUP else "float32"
    logger.info("dtype auto: bf16 matmul %.2fx fp32 on this CPU (%s): %s", speedup, ", ".join(flags) or "no SIMD flags",
                chosen)
    return chosen
