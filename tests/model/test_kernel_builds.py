"""The C++ kernels build for every CPU family these machines have, not only for the one at hand.

A kernel build that fails is not an error at run time: the engine logs a warning and runs the
portable torch path, several times slower (on 2026-12-06 an AMD Zen4 ran the reference workload at
~0.6x its speed because quant_cpu.cpp named the AMX kernel in a build for AVX-512 without AMX, and
every test that needs the kernels skipped). So: the machine's own build must succeed wherever a
compiler is present, and the sources must compile (``-fsyntax-only``, templates instantiated) with
the flags `cpu_kernels._cpu_flags` gives each family's CPU, whatever CPU runs the test.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import pytest

from conveyor.model.cpu_kernels import _SOURCES, _cpu_flags, cflags, load_cpu_kernels

# /proc/cpuinfo flags of each family's CPU, as far as the build looks at them. The AVX2 build is
# built in full (and run) by test_quant_avx2.py.
BASE = "avx2 fma f16c"
AVX512 = BASE + " avx512f avx512bw avx512vl"
FAMILIES = {
    "avx512_bf16_vnni (Zen4, Zen5)": AVX512 + " avx512_vnni avx512_bf16",
    "avx512 (Skylake-X)": AVX512,
    "portable (no AVX2)": "",
    "avx_vnni (Alder Lake)": BASE + " avx_vnni",
    "avx512_vnni (Cascade Lake, Ice Lake)": AVX512 + " avx512_vnni",
    "amx (Sapphire Rapids)": AVX512 + " avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16",
}
DEFAULT = ("avx512_bf16_vnni (Zen4, Zen5)",)


def _compiler() -> list[str] | None:
    from torch.utils.cpp_extension import get_cxx_compiler

    try:
        cxx = shlex.split(get_cxx_compiler())
        subprocess.run([*cxx, "--version"], capture_output=True, check=True, timeout=60)
        return cxx
    except (OSError, subprocess.SubprocessError):
        return None


def test_the_kernels_build_on_this_machine():
    if os.environ.get("CONVEYOR_KERNELS", "auto") == "torch":
        pytest.skip("CONVEYOR_KERNELS=torch")
    if _compiler() is None:
        pytest.skip("no C++ compiler here")
    assert load_cpu_kernels() is not None, "the C++ kernels failed to build here (see the warning logged)"


@pytest.mark.parametrize("family", [f if f in DEFAULT else pytest.param(f, marks=pytest.mark.heavy) for f in FAMILIES])
def test_the_kernels_compile_for_each_cpu_family(family):
    from torch.utils.cpp_extension import include_paths

    cxx = _compiler()
    if cxx is None:
        pytest.skip("no C++ compiler here")
    flags = _cpu_flags(set(FAMILIES[family].split()))
    if "amx" in family and "-mamx-tile" not in flags:
        pytest.skip("this compiler does not build AMX code")
    cmd = [*cxx, "-fsyntax-only", "-std=c++20", *cflags(flags), "-DTORCH_EXTENSION_NAME=conveyor_cpu_kernels",
           "-DTORCH_API_INCLUDE_EXTENSION_H", *(f"-I{p}" for p in include_paths()),
           f"-I{sysconfig.get_paths()['include']}"]

    def compile_one(source):
        done = subprocess.run([*cmd, str(source)], capture_output=True, text=True, timeout=600)
        return source.name, done.returncode, done.stderr

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(compile_one, _SOURCES))
    failed = {name: err[-3000:] for name, rc, err in results if rc != 0}
    assert not failed, f"{family} ({' '.join(flags)}): {failed}"
