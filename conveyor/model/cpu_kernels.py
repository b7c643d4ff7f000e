"""The optional C++ CPU kernels, compiled on first use with torch's JIT extension builder.

If compilation is impossible (no compiler, no ninja) the portable torch path is used.
Set CONVEYOR_ATTENTION=torch to force the portable path.
"""

from __future__ import annotations

import logging
import os
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)
_SRC = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"


def _cpu_flags() -> list[str]:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    return [f"-m{f}" for f in ("avx2", "fma", "f16c", "avx512f") if f in flags]


@cache
def load_cpu_kernels():
    """The compiled module, or None when unavailable or disabled."""
    if os.environ.get("CONVEYOR_ATTENTION", "auto") == "torch":
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(name="conveyor_paged_attention_cpu", sources=[str(_SRC)],
                    extra_cflags=["-O3", "-ffast-math", "-fopenmp", *_cpu_flags()], extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # compiler or ninja missing, unsupported platform
        log.warning("C++ paged attention unavailable (%s); using the portable torch path", e)
        return None
