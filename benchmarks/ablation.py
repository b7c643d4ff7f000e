"""What each performance change bought: the reference workload with the changes switched off
one at a time, in the same run (fresh processes, interleaved rounds, medians).

    python benchmarks/ablation.py [--rounds 2] [--dtypes bfloat16,float32]

Configurations, from the portable baseline up:
- torch path: CONVEYOR_KERNELS=torch (no C++ kernels), CONVEYOR_PACKED_LINEAR=off, CONVEYOR_HUGE_PAGES=off,
  CONVEYOR_GEMV=off;
- + C++ kernels (paged decode on the dtype's KV cache, fused norm/rope/silu, KV write, argmax);
- + oneDNN prepacked linear weights (where the probe finds them faster: bf16 on this CPU);
- + huge pages for the KV cache;
- + the C++ GEMV for steps of a few tokens, with every decoder layer in one C++ call (the
  default engine on dense weights);
- + the GGUF's Q4_1/Q8_0 weights computed as stored (``--quantization auto``, the default engine
  on the demo GGUF; every row above runs it dequantized, ``--quantization none``).
Writes benchmarks/results/ablation.json and a line in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from common import ROOT, save

CONFIGS = {
    "torch path": {"CONVEYOR_KERNELS": "torch", "CONVEYOR_PACKED_LINEAR": "off", "CONVEYOR_HUGE_PAGES": "off",
                   "CONVEYOR_GEMV": "off"},
    "+ C++ kernels": {"CONVEYOR_PACKED_LINEAR": "off", "CONVEYOR_HUGE_PAGES": "off", "CONVEYOR_GEMV": "off"},
    "+ prepacked linears": {"CONVEYOR_HUGE_PAGES": "off", "CONVEYOR_GEMV": "off"},
    "+ huge pages": {"CONVEYOR_GEMV": "off"},
    "+ GEMV and fused decode": {},
    "+ quantized weights as stored (default)": {"ABLATION_QUANTIZATION": "auto"},
}


def worker(dtype: str) -> float:
    sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
    from offline_worker import run_conveyor, workload

    reqs = workload(64)
    return sum(m for _, m in reqs) / run_conveyor(None, dtype, reqs, 64)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--worker")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps({"tok_s": worker(args.worker)}))
        return
    results = {}
    for dtype in args.dtypes.split(","):
        runs: dict[str, list[float]] = {name: [] for name in CONFIGS}
        for r in range(args.rounds):
            for name, env in (CONFIGS.items() if r % 2 == 0 else reversed(CONFIGS.items())):
                out = subprocess.run([sys.executable, __file__, "--worker", dtype], env={**os.environ, **env},
                                     capture_output=True, text=True, check=True, cwd=ROOT / "benchmarks")
                runs[name].append(json.loads(out.stdout.strip().splitlines()[-1])["tok_s"])
                print(f"{dtype} {name}: {runs[name][-1]:.1f} tok/s", flush=True)
        results[dtype] = {name: {"runs": v, "median_tok_s": statistics.median(v)} for name, v in runs.items()}
    line = "; ".join(f"{d}: " + ", ".join(f"{n} {v['median_tok_s']:.0f}" for n, v in r.items())
                     for d, r in results.items())
    save("ablation", {"configs": CONFIGS, "results": results}, "reference workload, output tok/s by change: " + line)


if __name__ == "__main__":
    main()
