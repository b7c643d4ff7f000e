"""Does this machine run the same step at the same speed from one second to the next?

The simulator prices a step from a profile taken once. Near saturation a queue multiplies a
step-cost error several times over (docs/simulator.md: elasticities of 3-9 at 80% load), so the
latency targets of a capacity plan hold only on a machine whose speed holds still to a few percent
over a run. This times identical steps back to back (a batch-1 decode at 128 tokens of context, 16
sequences decoding at 256, a 256-token prefill chunk: the profile's own synthetic plans, fresh
sequences every time) for blocks of ``--block`` seconds, alternating the torch thread counts given
(default: all cores, then 1), and reports per thread count and shape the median step and how far
the medians of 2-second windows move around it (min, max, standard deviation), with the CPU time
the hypervisor reported stolen over the whole run (/proc/stat's steal, Linux only).

Alternating in one process puts every thread count through the same stretch of the machine's
weather. Writes JSON and a line in docs/benchmarks.md.

    python benchmarks/machine_steadiness.py [--block 20] [--blocks 12] [--threads 2,1] [--name NAME]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from common import save
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
from conveyor.profile import _Plans

WINDOW_S = 2.0


def cpu_times() -> list[int] | None:
    """The aggregate CPU line of /proc/stat (user nice system idle iowait irq softirq steal), or None."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None


def windows(rows: list[tuple[float, float]], window: float = WINDOW_S) -> dict:
    """(start time, seconds) of one shape's steps -> the 2-s windows' median step relative to the
    median over all of them."""
    median = statistics.median(s for _, s in rows)
    by_window: dict[int, list[float]] = {}
    for t, s in rows:
        by_window.setdefault(int(t // window), []).append(s)
    ratios = [statistics.median(v) / median for v in by_window.values() if len(v) >= 2]
    return {"steps": len(rows), "median_ms": 1e3 * median, "windows": len(ratios),
            "min": min(ratios), "max": max(ratios), "sd": statistics.pstdev(ratios),
            "ratios": [round(r, 3) for r in ratios]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block", type=float, default=20.0, help="seconds per block of one thread count")
    ap.add_argument("--blocks", type=int, default=12, help="blocks in all, thread counts in turn")
    ap.add_argument("--threads", default=f"{os.cpu_count() or 1},1", help="thread counts to alternate")
    ap.add_argument("--name", default="machine_steadiness", help="results JSON name")
    args = ap.parse_args()
    counts = [int(x) for x in args.threads.split(",")]
    engine = Engine(EngineConfig.from_options(cost_model="none"))
    plans = _Plans(engine, seed=1, prefix="steady-")
    shapes = {"decode 1@128": [plans.seq(128, 1)], "decode 16@256": [plans.seq(256, 1) for _ in range(16)],
              "prefill 256@0": [plans.seq(0, 256)]}
    for threads in counts:   # warm-up: kernels built and probed at each thread count
        torch.set_num_threads(threads)
        start = time.perf_counter()
        while time.perf_counter() - start < 3:
            for seqs in shapes.values():
                engine.runner.execute(plans.plan(seqs))
    rows: dict[int, dict[str, list]] = {n: {name: [] for name in shapes} for n in counts}
    before, origin = cpu_times(), time.perf_counter()
    for block in range(args.blocks):
        threads = counts[block % len(counts)]
        torch.set_num_threads(threads)
        start = time.perf_counter()
        while time.perf_counter() - start < args.block:
            for name, seqs in shapes.items():
                plan = plans.plan(seqs)
                t = time.perf_counter()
                engine.runner.execute(plan)
                rows[threads][name].append((t - origin, time.perf_counter() - t))
        print(f"block {block + 1}/{args.blocks} ({threads} threads) done", flush=True)
    after = cpu_times()
    steal = None
    if before and after:
        delta = [b - a for a, b in zip(before, after)]
        steal = delta[7] / max(1, sum(delta))
    stolen = "n/a" if steal is None else f"{100 * steal:.2f}%"
    result = {str(n): {name: windows(r) for name, r in by_shape.items()} for n, by_shape in rows.items()}
    for n, by_shape in result.items():
        for name, w in by_shape.items():
            print(f"{n} threads, {name}: median {w['median_ms']:.2f} ms, 2-s windows {w['min']:.2f}-{w['max']:.2f}x, "
                  f"sd {100 * w['sd']:.1f}%")
    print(f"CPU time stolen by the hypervisor: {stolen}")
    line = "; ".join(f"{n} threads: " + ", ".join(f"{name} {w['median_ms']:.1f} ms ({w['min']:.2f}-{w['max']:.2f}x, "
                                                     f"sd {100 * w['sd']:.1f}%)" for name, w in by_shape.items())
                     for n, by_shape in result.items())
    save(args.name, {"block_s": args.block, "blocks": args.blocks, "window_s": WINDOW_S, "threads": counts,
                     "steal_fraction": steal, "shapes": result},
         f"identical steps, {args.blocks} blocks of {args.block:.0f} s alternating {args.threads} threads, "
         f"2-s windows' median relative to the whole: {line}; stolen CPU {stolen}")


if __name__ == "__main__":
    sys.exit(main())
