"""``dtype="auto"``: the compute dtype this machine runs best, the same at every start.

On CUDA: bf16 where the GPU supports it, else fp16. On a CPU the CPU's features decide, not a
timing (which a busy machine can turn around: a bf16/fp32 probe once measured 0.28x under load
and 4.4x idle on the same machine, and the choice changed greedy outputs between two restarts):
bf16 where the CPU has native bf16 matmuls (AMX or AVX512-BF16), fp32 where it does not (bf16 is
then emulated and slower than fp32 on every CPU measured). Flags alone are not trusted either —
a VM can report them while the hypervisor traps the instructions — so with native flags a probe
of a decoder-sized matmul can veto bf16, but only if it runs below half of fp32's speed, far from
noise; and its answer is measured once per machine and remembered (probe_cache.py), so it cannot
flip between starts. The choice and its reason are logged.
"""

from __future__ import annotations

import logging
import time
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from conveyor.model import probe_cache
from conveyor.model.linear import _ops_available, pack, packed_linear

logger = logging.getLogger(__name__)

# Native bf16 flags choose bf16 unless a probe measured it below this fraction of fp32's speed.
VETO_SPEEDUP = 0.5
NATIVE_BF16 = ("amx_bf16", "avx512_bf16")


def cpu_flags() -> set[str]:
    return probe_cache.cpu_info()[1]


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
    """The dtype to run: `spec` itself, or for "auto" what this device runs best (module docstring)."""
    if spec != "auto":
        return spec
    if torch.device(device).type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    chosen, why = cpu_auto_dtype(cpu_flags())
    logger.info("dtype auto: %s (%s)", chosen, why)
    return chosen


def cpu_auto_dtype(flags: set[str]) -> tuple[str, str]:
    """(dtype, the reason) for this CPU's flags; the probe runs only where the flags say bf16."""
    native = sorted(flags & set(NATIVE_BF16))
    if not native:
        return "float32", "no native bf16 matmul on this CPU (no AMX or AVX512-BF16): bf16 would be emulated"
    speedup = float(probe_cache.remembered("bf16_speedup", bf16_speedup_on_cpu))
    if speedup < VETO_SPEEDUP:
        return "float32", (f"the CPU reports {', '.join(native)}, but bf16 ran at {speedup:.2f}x fp32 when first "
                           "measured on this machine (trapped or emulated)")
    return "bfloat16", f"native bf16 ({', '.join(native)}); measured {speedup:.2f}x fp32 on this machine"
