"""Decode at batch 1 against the machine's memory bandwidth, measured in the same run.

A batch-1 decode step must read every weight once, so its floor is (weight bytes) / (memory
bandwidth). The bandwidth is the best of 3 sums over a 1 GiB tensor with the engine's threads;
the step, the median of 15 decode steps of one sequence (128 tokens of context) through the
engine's ModelRunner. The machine's bandwidth drifts (other tenants share it: 22-32 GB/s seen on
one machine within an hour), so bandwidth and steps are measured in alternation, 5 rounds, and
each round's ratio uses that round's bandwidth; the table gives the medians. Three variants of
the same engine, switched in place:

- ``onednn``: every matmul through oneDNN (prepacked where that pays) or F.linear;
- ``gemv``: matmuls of <= a few tokens through the C++ GEMV (csrc/gemv_cpu.cpp), Python layer loop;
- ``gemv+fused``: the same, all decoder layers in one C++ call (csrc/decode_layers_cpu.cpp) --
  what the engine runs.

The issue's bar: step <= 1.5x the floor.

    python benchmarks/decode_b1.py [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import save
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
from conveyor.model.linear import CpuLinear
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
    m = engine.model_config
    per_layer = m.hidden_size * (m.q_size + 2 * m.kv_size) + m.q_size * m.hidden_size + 3 * m.hidden_size * m.intermediate_size
    params = m.num_hidden_layers * per_layer + m.vocab_size * m.hidden_size
    return params * getattr(torch, engine.dtype).itemsize


class Variants:
    """Switches one engine between the variants in place."""

    def __init__(self, engine: Engine):
        self.model = engine.runner.model
        self.linears = [m for m in self.model.modules() if isinstance(m, CpuLinear)] + \
            ([self.model.cpu_lm_head] if self.model.cpu_lm_head is not None else [])
        self.gemv = {id(m): m.gemv_max for m in self.linears}
        self.fused = self.model.fused_decode_tokens

    def names(self) -> list[str]:
        out = ["onednn"]
        if any(self.gemv.values()):
            out.append("gemv")
        if self.fused:
            out.append("gemv+fused")
        return out

    def use(self, name: str) -> None:
        for m in self.linears:
            m.gemv_max = 0 if name == "onednn" else self.gemv[id(m)]
        self.model.fused_decode_tokens = self.fused if name == "gemv+fused" else 0


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
    args = ap.parse_args()
    x = torch.ones((1 << 30) // 4)
    x.sum()
    rows = {}
    for dtype in args.dtypes.split(","):
        engine = Engine(EngineConfig(dtype=dtype, cost_model="none"))
        plans = _Plans(engine)
        plan = plans.plan([plans.seq(128, 1)])
        variants = Variants(engine)
        wbytes = weight_bytes(engine)
        bws, steps = [], {n: [] for n in variants.names()}
        for _ in range(ROUNDS):
            bws.append(bandwidth(x))
            for name in steps:
                variants.use(name)
                steps[name].append(decode_step(engine, plan))
        variants.use(variants.names()[-1])
        rows[dtype] = {"weights_mb": wbytes / 1e6, "bandwidth_gb_s": statistics.median(bws) / 1e9,
                       "bandwidth_rounds_gb_s": [b / 1e9 for b in bws], "variants": {
                           name: {"step_ms": 1e3 * statistics.median(ts),
                                  "ratio": statistics.median(t * bw / wbytes for t, bw in zip(ts, bws))}
                           for name, ts in steps.items()}}
        print(dtype, rows[dtype], flush=True)
    line = "; ".join(
        f"{d}: {r['weights_mb']:.0f} MB of weights, {r['bandwidth_gb_s']:.1f} GB/s; step / weight-read time: " + ", ".join(
            f"{n} {v['step_ms']:.1f} ms = {v['ratio']:.2f}x" for n, v in r["variants"].items())
        for d, r in rows.items())
    save("decode_b1", {"rounds": ROUNDS, "rows": rows}, line)


if __name__ == "__main__":
    main()
