"""Per-shape matmul throughput of every CPU backend on the demo model's shapes, against the
machine's achievable peak, for fp32 and bf16.

Backends (each where it exists on this machine and dtype):

- ``mkl``: ``F.linear`` (MKL's sgemm for fp32; torch routes bf16 to oneDNN);
- ``onednn``: oneDNN with the weight prepacked once (``torch.ops.mkldnn._linear_pointwise``);
- ``gemv``: Conveyor's C++ small-batch kernel (up to 8 tokens);
- ``q_vnni``, ``q_amx``: the int8 kernel on the same weight quantized to Q4_1 (the demo GGUF's type; the
  x16 layout), VNNI alone and with AMX tiles for 16+ tokens (where the CPU has AMX-INT8). Counted as
  the dense product's FLOPs (its two int8 terms do twice the integer work).

The shapes are the demo model's (SmolLM2-135M: qkv 576x960, o 576x576, gate_up 576x3072, down
1536x576, LM head 576x49152) at 1-512 tokens. "Peak" is the best rate any backend reaches on a
large square product (2048^3): what this CPU's cores deliver, not a datasheet number. Backends
alternate inside each round; each cell is the median of `--rounds` rounds.

    python benchmarks/gemm_shapes.py [--dtypes float32,bfloat16] [--rounds 5] [--name gemm_shapes]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from common import save
from conveyor.model.cpu_kernels import cpu_kernels
from conveyor.model.linear import MAX_GEMV_TOKENS, pack, packed_linear

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def backends(dtype: torch.dtype, w: torch.Tensor) -> dict:
    out = {"mkl": lambda x: F.linear(x, w)}
    try:
        pw = pack(w)
        packed_linear(torch.zeros(2, w.shape[1], dtype=dtype), pw, None)
        out["onednn"] = lambda x: packed_linear(x, pw, None)
    except Exception:   # noqa: BLE001 - op missing here
        pass
    kernels = cpu_kernels("cpu", dtype)
    if kernels is not None:
        out["gemv"] = lambda x: kernels.gemv(x, w, None) if x.shape[0] <= MAX_GEMV_TOKENS else None
    if kernels is not None and kernels.quant_int8_native():
        import gguf
        import gguf.quants

        from conveyor.model.quant import QuantTensor

        q = gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType.Q4_1)
        data = QuantTensor(torch.from_numpy(q), "Q4_1", w.shape[1]).for_int8().data

        def int8(amx: bool):
            def run(x):
                kernels.set_int8_amx(amx)
                try:
                    return kernels.qgemv(x, data, None)
                finally:
                    kernels.set_int8_amx(True)
            return run
        out["q_vnni"] = int8(False)
        if kernels.int8_amx():
            out["q_amx"] = lambda x: int8(True)(x) if x.shape[0] >= kernels.int8_amx_tokens() else None
    return out


def timed(fn, x, budget: float = 0.05) -> float | None:
    """Seconds per call: warm, then as many calls as fit in ~`budget` seconds (at least 3)."""
    if fn(x) is None:
        return None
    fn(x)
    t0 = time.perf_counter()
    n = 0
    while n < 3 or time.perf_counter() - t0 < budget:
        fn(x)
        n += 1
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--name", default="gemm_shapes")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    result = {"threads": torch.get_num_threads(), "peak_gflops": {}, "gflops": {}}
    lines = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        big = torch.randn(2048, 2048, dtype=dtype)
        peak_runs = {b: [] for b in backends(dtype, big)}
        for _ in range(3):
            for b, fn in backends(dtype, big).items():
                t = timed(fn, big, budget=0.3)
                if t is not None:
                    peak_runs[b].append(2 * 2048 ** 3 / t / 1e9)
        peak = {b: max(v) for b, v in peak_runs.items() if v}
        result["peak_gflops"][name] = peak
        top = max(peak.values())
        print(f"{name}: peak (2048^3) " + ", ".join(f"{b} {g:.0f}" for b, g in peak.items()) + " GFLOP/s", flush=True)
        table = result["gflops"][name] = {}
        for shape in args.shapes.split(","):
            k, n = SHAPES[shape]
            w = torch.randn(n, k, dtype=dtype)
            fns = backends(dtype, w)
            xs = {m: torch.randn(m, k, dtype=dtype) for m in tokens}
            runs = {(m, b): [] for m in tokens for b in fns}
            for _ in range(args.rounds):
                for m in tokens:
                    for b, fn in fns.items():   # alternate backends inside the round
                        t = timed(fn, xs[m])
                        if t is not None:
                            runs[m, b].append(t)
            table[shape] = {}
            for m in tokens:
                row = {b: 2 * m * k * n / statistics.median(v) / 1e9 for (mm, b), v in runs.items() if mm == m and v}
                table[shape][m] = row
                best = max(row, key=row.get)
                print(f"  {shape:8s} {m:4d} tok: " + "  ".join(f"{b} {g:6.1f}" for b, g in row.items())
                      + f"  best {best} ({row[best] / top:.0%} of peak)", flush=True)
        lines.append(f"{name} peak {top:.0f} GFLOP/s")
    save(args.name, result, "per-shape matmul GFLOP/s by backend; " + "; ".join(lines))


if __name__ == "__main__":
    main()
