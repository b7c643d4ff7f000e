"""The int8 kernel on CPUs without AVX-512 (csrc/quant_cpu.cpp's AVX2 path).

Built here by restricting the flags the kernels are compiled for (``CONVEYOR_CPU_FLAGS="avx2 fma
f16c"``, and with ``avx_vnni`` AVX-VNNI's 256-bit vpdpbusd: a build of its own, run in a child
process, this file run as a script), the AVX2 path
must give every output of the machine's own int8 kernel (AVX512-VNNI, AMX for large steps) to the
bit -- the int32 dot products are exact on both and scaled by the same operations lane by lane --
for every GGUF type it keeps as stored, and a GGUF model must load its blocks as stored there (not
a dequantized copy) and generate the same greedy tokens. Before this path, AVX2-only CPUs
dequantized every GGUF at load, and the kernels did not even build there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conveyor.model.cpu_kernels import load_cpu_kernels
from conveyor.model.probe_cache import _first_processor
from conveyor.model.quant import K_SUPER_BYTES, NATIVE_BLOCK_BYTES

AVX2_FLAGS = "avx2 fma f16c"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "1, 2, 3, 5, 8,"]


def int8_outputs(kernels) -> dict[str, torch.Tensor]:
    """qgemv of every type in the int8 layout (3 groups of 16 rows, K = 512), tokens 1 to 40 (leftover
    passes, and AMX's 16-token tiles where the machine has them), fp32 and bf16, with a bias."""
    from test_quant import _quantized, _random_k

    weights = {q: _quantized(q, 48, 512, seed=i)[0] for i, q in enumerate(sorted(NATIVE_BLOCK_BYTES))}
    weights |= {q: _random_k(q, 48, 512, seed=10 + i)[0] for i, q in enumerate(sorted(K_SUPER_BYTES))}
    g = torch.Generator().manual_seed(0)
    out = {}
    for tokens in (1, 3, 8, 13, 40):
        x = torch.randn(tokens, 512, generator=g)
        x[0, 32:64] = 0   # an all-zero block: scale 0
        bias = torch.randn(48, generator=g)
        for dtype in (torch.float32, torch.bfloat16):
            for qtype, w in weights.items():
                r = w.for_int8()
                assert r.x16
                out[f"{qtype}/{tokens}/{dtype}"] = kernels.qgemv(x.to(dtype), r.data, bias.to(dtype))
    return out


def demo_greedy() -> tuple[list[list[int]], list[str]]:
    """The demo GGUF's greedy tokens (fp32, 32 each) and the kinds of weights it holds."""
    from conveyor.engine.llm import LLM
    from conveyor.model.loader import demo_model_path
    from conveyor.sampling.params import SamplingParams

    llm = LLM(str(demo_model_path()), dtype="float32", num_kv_blocks=64)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], sorted(llm.engine.loaded.model.weight_bytes())


@pytest.fixture(scope="module", params=[AVX2_FLAGS, pytest.param(AVX2_FLAGS + " avx_vnni", marks=pytest.mark.heavy)],
                ids=["avx2", "avx_vnni"])
def avx2(request, tmp_path_factory) -> dict:
    """What the AVX2 build computes (the child process); with AVX-VNNI (the VEX vpdpbusd) too."""
    flags = set(_first_processor().get("flags", "").split())
    if not set(request.param.split()) <= flags:
        pytest.skip(f"this CPU lacks some of {request.param}")
    native = load_cpu_kernels()
    if native is None or not native.quant_int8_native():
        pytest.skip("no int8 kernel in this machine's build to compare with")
    out = tmp_path_factory.mktemp("avx2") / "outputs.pt"
    env = {**os.environ, "CONVEYOR_CPU_FLAGS": request.param}
    done = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out)


def test_the_avx2_int8_kernel_gives_the_vnni_kernels_bits(avx2):
    assert avx2["int8_native"] and not avx2["avx512"]
    want = int8_outputs(load_cpu_kernels())
    assert sorted(avx2["outputs"]) == sorted(want)
    differ = [k for k, v in want.items() if not torch.equal(avx2["outputs"][k], v)]
    assert not differ


def test_a_gguf_model_keeps_its_blocks_and_its_tokens_on_avx2(avx2):
    from conveyor.model.loader import ModelNotFoundError, demo_model_path

    try:
        demo_model_path()
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    tokens, kinds = avx2["demo"]
    assert kinds == ["Q4_1", "Q8_0", "float32"]   # the file's blocks (and the norms), no dense copy
    assert tokens == demo_greedy()[0]


if __name__ == "__main__":   # the child: CONVEYOR_CPU_FLAGS set by the fixture
    from conveyor.model import probe_cache
    from conveyor.model.loader import ModelNotFoundError

    kernels = load_cpu_kernels()
    result = {"int8_native": bool(kernels.quant_int8_native()), "avx512": "avx512f" in probe_cache.cpu_info()[1],
              "outputs": int8_outputs(kernels)}
    try:
        result["demo"] = demo_greedy()
    except ModelNotFoundError:
        pass
    torch.save(result, Path(sys.argv[1]))
