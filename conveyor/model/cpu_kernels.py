"""The optional C++ CPU kernels (paged decode attention and fused elementwise ops), compiled
on first use with torch's JIT extension builder (cached under ~/.cache/torch_extensions).

If compilation is impossible (no compiler, no ninja) the portable torch path is used.
Set CONVEYOR_KERNELS=torch to force the portable path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shlex
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from conveyor.model import probe_cache

log = logging.getLogger(__name__)
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("bindings.cpp", "paged_attention_cpu.cpp", "fused_ops_cpu.cpp", "gemv_cpu.cpp",
                                             "decode_layers_cpu.cpp", "quant_cpu.cpp", "lora_cpu.cpp", "moe_cpu.cpp")]


def _cpu_flags(flags: set[str] | None = None) -> list[str]:
    """The compiler's ISA flags for a CPU with `flags` (/proc/cpuinfo's names; default: this one's)."""
    flags = probe_cache.cpu_info()[1] if flags is None else flags
    out = [f"-m{f}" for f in ("avx2", "fma", "f16c", "avx512f") if f in flags]
    if "avx_vnni" in flags and "avx2" in flags:
        out += ["-mavxvnni"]
    if "avx512_bf16" in flags and "avx512f" in flags:
        out += ["-mavx512bf16", "-mavx512bw", "-mavx512vl"]
    if "avx512_vnni" in flags and "avx512bw" in flags:
        out += ["-mavx512vnni", "-mavx512bw"]
        if {"amx_tile", "amx_int8"} <= set(flags) and _compiler_builds_amx(["-mamx-tile", "-mamx-int8"]):
            out += ["-mamx-tile", "-mamx-int8"]
    return out


def _compiler_builds_amx(flags: list[str]) -> bool:
    """Whether the C++ compiler and assembler build AMX code with `flags` (an old compiler or binutils
    may not know AMX's; the kernels then build without it rather than not at all). The probe compile
    takes ~1 s, so its answer is remembered per machine and compiler version."""
    # lazy: keeps torch's extension builder (~0.1 s) out of processes that never build the kernels
    from torch.utils.cpp_extension import get_cxx_compiler

    cxx = shlex.split(get_cxx_compiler())

    def probe() -> bool:
        source = b"#include <immintrin.h>\nint main() { _tile_zero(0); _tile_release(); return 0; }\n"
        with tempfile.TemporaryDirectory() as tmp:
            return subprocess.run([*cxx, *flags, "-x", "c++", "-c", "-", "-o", os.path.join(tmp, "probe.o")],
                                  input=source, capture_output=True, timeout=60).returncode == 0

    try:
        version = subprocess.run([*cxx, "-dumpfullversion"], capture_output=True, text=True, timeout=60).stdout.strip()
        return bool(probe_cache.remembered(f"compiler_builds_amx/{' '.join(cxx)} {version}", probe))
    except (OSError, subprocess.SubprocessError):
        return False


@cache
def load_cpu_kernels():
    """The compiled module, or None when unavailable or disabled."""
    if os.environ.get("CONVEYOR_KERNELS", "auto") == "torch":
        return None
    try:
        # lazy: keeps torch's extension builder (~0.1 s) out of processes that never build the kernels
        from torch.utils.cpp_extension import load

        _put_ninja_on_path()

        flags = _cpu_flags()
        module = load(name=f"{_module_name(flags)}_{_tree_tag()}", sources=[str(p) for p in _SOURCES],
                      extra_cflags=cflags(flags), extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # compiler or ninja missing, unsupported platform
        log.warning("the C++ CPU kernels are unavailable (%s): attention, matmuls and fused ops run on the "
                    "portable torch path, several times slower", e)
        return None
    # AMX tiles for the int8 kernel's large steps (the same bits as VNNI): off to compare.
    module.set_int8_amx(os.environ.get("CONVEYOR_INT8_AMX", "auto") != "off")
    return module


def cflags(isa_flags: list[str]) -> list[str]:
    """The kernels' compiler flags beside torch's: optimization, OpenMP, the ISA's (`_cpu_flags`)."""
    return ["-O3", "-ffast-math", "-fopenmp", *isa_flags, _headers_flag()]


def _module_name(flags: list[str]) -> str:
    """The extension's name: with $CONVEYOR_CPU_FLAGS (probe_cache.cpu_info) a build of its own per
    set of compiler `flags`, so that it neither replaces the machine's full build in torch's cache
    nor is loaded in its place."""
    if "CONVEYOR_CPU_FLAGS" not in os.environ:
        return "conveyor_cpu_kernels"
    return "conveyor_cpu_kernels_" + hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:8]


def _tree_tag() -> str:
    """8 hex digits naming this source tree: the build (a folder of torch's extensions cache, under
    $TORCH_EXTENSIONS_DIR or per Python and CUDA version) is one per tree, since ninja's build file
    names the sources by path: two checkouts sharing one build (a worktree beside the main one) would
    rebuild every object each time the other loaded the kernels (minutes on 2 cores, the other
    waiting on the build's lock)."""
    return hashlib.sha256(str(_CSRC.resolve()).encode()).hexdigest()[:8]


def kernels_digest() -> str:
    """The C++ kernels' sources and headers, hashed: a profile records it (``meta.kernels``) and an
    engine loading a profile measured on other kernels says so (engine.warn_if_profile_stale); a
    kernel change can move step costs without moving any dispatch threshold (2026-12-06: the attention
    prefetch made decode steps over long scattered contexts up to 1.25x faster)."""
    return _digest(p for p in _CSRC.iterdir() if p.is_file())


def _headers_flag() -> str:
    """A define naming the headers' content: torch rebuilds a JIT extension when its sources or flags
    change, not its headers, so a change to a header alone would keep the old module."""
    return f"-DCONVEYOR_HEADERS={_digest(_CSRC.glob('*.h'))}"


def _digest(paths) -> str:
    """16 hex digits of the SHA-256 of the files' contents, in path order."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(paths))).hexdigest()[:16]


def _put_ninja_on_path() -> None:
    """torch looks for `ninja` on PATH; the pip package's binary may not be there (venv not activated)."""
    try:
        import ninja   # lazy: optional dependency (ninja)
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path


def cpu_kernels(device, dtype):
    """The kernels when they apply to this device and dtype (CPU, fp32 or bf16), else None."""
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    return load_cpu_kernels()
