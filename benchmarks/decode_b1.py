"""Decode at batch 1 against the machine's memory bandwidth, measured in the same run.

A batch-1 decode step must read every weight once, so its floor is (weight bytes) / (memory
bandwidth). The bandwidth is the best of 3 sums over a 1 GiB tensor with the engine's threads;
the step, the median of 15 decode steps of one sequence (128 tokens of context) through the
engine's ModelRunner. The machine's bandwidth drifts (other tenants share it: 22-32 GB/s seen on
one machine within an hour), so bandwidth and steps are measured in alternation, 5 rounds, and
each round's ratio uses that round's bandwidth; the table gives the medians. All engines are
loaded first and measured in the same rounds. Variants of each engine, switched in place:

- ``onednn``: every matmul through oneDNN (prepacked where that pays) or F.linear;
- ``gemv``: matmuls of <= a few tokens through the C++ GEMV (csrc/gemv_cpu.cpp), Python layer loop;
- ``gemv+fused``: the same, all decoder layers in one C++ call (csrc/decode_layers_cpu.cpp) --
  what the engine runs with ``--quantization none``;
- ``quant`` / ``quant+fused``: the GGUF's Q4_1/Q8_0 blocks as stored (csrc/quant_cpu.cpp), Python
  layer loop / one C++ call -- what the engine runs by default on a GGUF (``--quantization auto``).
  Its floor is the quantized bytes read per token (96 MB for the demo model against 538 in fp32).

The issue's bar: step <= 1.5x the floor.

    python benchmarks/decode_b1.py [--dtypes float32,bfloat16] [--quantization none,auto] [--bf16-kernels]
                                   [--name NAME]

As on an AVX2-only CPU (the kernels built without AVX-512, MKL, oneDNN and ATen held to AVX2):
``CONVEYOR_CPU_FLAGS="avx2 fma f16c" MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
ATEN_CPU_CAPABILITY=avx2 python benchmarks/decode_b1.py --dtypes float32 --name decode_b1_avx2``.

``--bf16-kernels``: bf16 on the GGUF as stored twice, on the int8 kernel and on the bf16-rounding
kernel (``CONVEYOR_QUANT_BF16``; the CPU's flags choose one of them by default), in the same rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from common import save
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
from conveyor.model.linear import CpuLinear
from conveyor.model.quant import QuantLinear
from conveyor.profile import _Plans

ROUNDS = 5


def bandwidth(x: torch.Tensor) -> float:
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * x.itemsize / best


def weight_bytes(engine: Engine) -> int:
    """Bytes a decode step reads: every matmul weight and the LM head (the embedding lookup reads a row)."""
    model = engine.runner.model
    quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if quant:   # the blocks as stored (the tied LM head shares the embedding's)
        head = [] if isinstance(model.cpu_lm_head, QuantLinear) else [model.lm_head_weight()]
        return sum(m.qweight.numel() for m in {id(m): m for m in [*quant, model.cpu_lm_head]}.values()
                   if isinstance(m, QuantLinear)) + sum(h.numel() * h.itemsize for h in head)
    m = engine.model_config
    per_layer = m.hidden_size * (m.q_size + 2 * m.kv_size) + m.q_size * m.hidden_size + 3 * m.hidden_size * m.intermediate_size
    params = m.num_hidden_layers * per_layer + m.vocab_size * m.hidden_size
    return params * getattr(torch, engine.dtype).itemsize


class Variants:
    """Switches one engine between the variants in place."""

    def __init__(self, engine: Engine):
        self.model = engine.runner.model
        self.linears = [m for m in [*self.model.modules(), self.model.cpu_lm_head] if isinstance(m, CpuLinear)]
        self.gemv = {id(m): m.gemv_max for m in self.linears}
        self.fused = self.model.fused_decode_tokens
        self.quant = any(isinstance(m, QuantLinear) for m in self.model.modules())

    def names(self) -> list[str]:
        if self.quant:
            return ["quant", "quant+fused"] if self.fused else ["quant"]
        out = ["onednn"]
        if any(self.gemv.values()):
            out.append("gemv")
        if self.fused:
            out.append("gemv+fused")
        return out

    def use(self, name: str) -> None:
        for m in self.linears:
            m.gemv_max = 0 if name == "onednn" else self.gemv[id(m)]
        self.model.fused_decode_tokens = self.fused if name.endswith("+fused") else 0


def decode_step(engine: Engine, plan, steps: int = 15) -> float:
    for _ in range(3):
        engine.runner.execute(plan)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.runner.execute(plan)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--quantization", default="none,auto", help="GGUF weights dequantized (none), as stored (auto)")
    ap.add_argument("--bf16-kernels", action="store_true",
                    help="bf16 as stored on both quantized kernels (int8 and bf16-rounding), in the same rounds")
    ap.add_argument("--name", default="decode_b1", help="results file name (benchmarks/results/NAME.json)")
    args = ap.parse_args()
    x = torch.ones((1 << 30) // 4)
    x.sum()
    # Every engine loaded first, then measured round by round in alternation (the machine's memory
    # speed drifts by 2x within an hour): rows of one run compare, and so do per-round ratios.
    setups = {}
    for dtype, quant in [(d, q) for d in args.dtypes.split(",") for q in args.quantization.split(",")]:
        kernels = ["int8", "bf16"] if args.bf16_kernels and dtype == "bfloat16" and quant != "none" else [None]
        for kernel in kernels:
            if kernel:   # read when the model is built
                os.environ["CONVEYOR_QUANT_BF16"] = kernel
            engine = Engine(EngineConfig(dtype=dtype, quantization=quant, cost_model="none"))
            os.environ.pop("CONVEYOR_QUANT_BF16", None)
            plans = _Plans(engine)
            key = dtype if quant == "none" else f"{dtype}/quantized" + (f" ({kernel} kernel)" if kernel else "")
            setups[key] = (engine, plans.plan([plans.seq(128, 1)]), Variants(engine), weight_bytes(engine))
    bws, steps = [], {key: {n: [] for n in v.names()} for key, (_, _, v, _) in setups.items()}
    for _ in range(ROUNDS):
        bws.append(bandwidth(x))
        for key, (engine, plan, variants, _) in setups.items():
            for name in steps[key]:
                variants.use(name)
                steps[key][name].append(decode_step(engine, plan))
            variants.use(variants.names()[-1])
    rows = {}
    for key, (engine, plan, variants, wbytes) in setups.items():
        rows[key] = {"weights_mb": wbytes / 1e6, "bandwidth_gb_s": statistics.median(bws) / 1e9,
                     "bandwidth_rounds_gb_s": [b / 1e9 for b in bws], "variants": {
                         name: {"step_ms": 1e3 * statistics.median(ts),
                                "ratio": statistics.median(t * bw / wbytes for t, bw in zip(ts, bws))}
                         for name, ts in steps[key].items()}}
        dense = key.split("/")[0]
        if dense != key and dense in steps:   # the quantized step against the dense one, round by round
            last, dense_last = list(steps[key])[-1], list(steps[dense])[-1]
            rows[key]["speedup_vs_dense"] = statistics.median(
                d / q for d, q in zip(steps[dense][dense_last], steps[key][last]))
        print(key, rows[key], flush=True)
    line = "; ".join(
        f"{d}: {r['weights_mb']:.0f} MB of weights, {r['bandwidth_gb_s']:.1f} GB/s; step / weight-read time: " + ", ".join(
            f"{n} {v['step_ms']:.1f} ms = {v['ratio']:.2f}x" for n, v in r["variants"].items()) +
        (f" ({r['speedup_vs_dense']:.2f}x faster than dense)" if "speedup_vs_dense" in r else "")
        for d, r in rows.items())
    save(args.name, {"rounds": ROUNDS, "rows": rows}, line)


if __name__ == "__main__":
    main()
