"""Synthetic Llama GGUF files at real model sizes (random weights), to measure memory, load time
and decode speed where the demo model is too small to tell.

    python benchmarks/synthetic_gguf.py --size 1b|8b --qtype Q4_0|Q5_1|Q8_0|Q2_K_M|Q3_K_M|Q4_K_M|Q5_K_M [--out DIR] [--measure]

The files are written by `conveyor.bench.synthetic_gguf` (shapes, types per tensor: see there). With
`--measure`: resident memory after load, load time and batch-1 decode steps against the bytes
read per token over the memory bandwidth measured in the same run; a JSON and a line in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from pathlib import Path

from conveyor.bench.synthetic_gguf import QTYPES, SIZES, write
from conveyor.model.loader import demo_model_path

ROOT = Path(__file__).resolve().parent.parent


def rss_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def measure(path: Path, dtype: str) -> dict:
    import torch

    from conveyor.config import EngineConfig
    from conveyor.engine.engine import Engine
    from conveyor.profile import _Plans
    from decode_b1 import bandwidth, decode_step, weight_bytes   # benchmarks/ is on the path when run as a script

    before = rss_gib()
    t = time.perf_counter()
    engine = Engine(EngineConfig(model=str(path), dtype=dtype, kv_cache_gib=2.0, cost_model="none"))
    load_s = time.perf_counter() - t
    after = rss_gib()
    model = engine.runner.model
    plans = _Plans(engine)
    plan = plans.plan([plans.seq(128, 1)])
    x = torch.ones((1 << 30) // 4)
    x.sum()
    wbytes = weight_bytes(engine)
    bws, steps = [], []
    for _ in range(3):
        bws.append(bandwidth(x))
        steps.append(decode_step(engine, plan, steps=5))
    return {"dtype": engine.dtype, "load_s": load_s, "rss_gib_after_load": after, "rss_gib_before": before,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "weights": model.weight_bytes(), "weights_summary": model.weight_bytes_summary(),
            "bytes_read_per_token_gb": wbytes / 1e9, "file_gb": path.stat().st_size / 1e9,
            "bandwidth_gb_s": statistics.median(bws) / 1e9, "step_ms": 1e3 * statistics.median(steps),
            "ratio": statistics.median(s * b / wbytes for s, b in zip(steps, bws))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--qtype", choices=QTYPES, default="Q4_0")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "synthetic")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--measure", action="store_true")
    args = ap.parse_args()
    from common import save

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"synthetic-llama-{args.size}-{args.qtype}.gguf"
    if not path.exists():
        t = time.perf_counter()
        write(args.size, args.qtype, args.out, demo_model_path())
        print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t:.0f} s", flush=True)
    if args.measure:
        res = measure(path, args.dtype)
        print(res, flush=True)
        save(f"synthetic_{args.size}_{args.qtype}", {"size": args.size, "qtype": args.qtype, **res},
             f"synthetic Llama {args.size} {args.qtype} ({res['file_gb']:.2f} GB file), {res['dtype']}: "
             f"loaded in {res['load_s']:.0f} s, resident {res['rss_gib_after_load']:.2f} GiB "
             f"(weights {res['weights_summary']}); batch-1 decode {res['step_ms']:.0f} ms = {res['ratio']:.2f}x "
             f"the {res['bytes_read_per_token_gb']:.2f} GB read per token at {res['bandwidth_gb_s']:.1f} GB/s")


if __name__ == "__main__":
    main()
