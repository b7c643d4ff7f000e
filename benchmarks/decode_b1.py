"""Decode at batch 1 against the machine's memory bandwidth, measured in the same run.

A batch-1 decode step must read every weight once, so its floor is (weight bytes) / (memory
bandwidth). The bandwidth is measured here as the best of several sums over a 1 GiB tensor
with the engine's threads; the step as the median of 50 decode steps of one sequence (128
tokens of context) through the engine's ModelRunner. The issue's bar: step <= 1.5x the floor.

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
from conveyor.profile import _Plans


def bandwidth(gib: float = 1.0) -> float:
    x = torch.ones(int(gib * (1 << 30) // 4))
    x.sum()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def weight_bytes(engine: Engine) -> int:
    """Bytes a decode step reads: every matmul weight and the LM head (the embedding lookup reads a row)."""
    m = engine.model_config
    per_layer = m.hidden_size * (m.q_size + 2 * m.kv_size) + m.q_size * m.hidden_size + 3 * m.hidden_size * m.intermediate_size
    params = m.num_hidden_layers * per_layer + m.vocab_size * m.hidden_size
    return params * getattr(torch, engine.dtype).itemsize


def decode_step(engine: Engine, steps: int = 50) -> float:
    plans = _Plans(engine)
    plan = plans.plan([plans.seq(128, 1)])
    for _ in range(5):
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
    bw = bandwidth()
    rows = {}
    for dtype in args.dtypes.split(","):
        engine = Engine(EngineConfig(dtype=dtype, cost_model="none"))
        step = decode_step(engine)
        floor = weight_bytes(engine) / bw
        rows[dtype] = {"step_ms": 1e3 * step, "weights_mb": weight_bytes(engine) / 1e6, "floor_ms": 1e3 * floor,
                       "ratio": step / floor}
        print(dtype, rows[dtype], flush=True)
    line = f"memory bandwidth {bw / 1e9:.1f} GB/s; " + "; ".join(
        f"{d}: batch-1 decode step {r['step_ms']:.1f} ms = {r['ratio']:.2f}x the {r['floor_ms']:.1f} ms to read "
        f"{r['weights_mb']:.0f} MB of weights" for d, r in rows.items())
    save("decode_b1", {"bandwidth_gb_s": bw / 1e9, "rows": rows}, line)


if __name__ == "__main__":
    main()
