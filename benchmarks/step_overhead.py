"""Per-step overhead of the engine: a step's wall time minus the time inside the model's forward.

Everything that is not the forward pass counts: scheduling, building the input tensors,
sampling, updating requests, detokenization and stop checks, output objects. Measured on the
demo model (fp32) for decode at batch 1 and batch 32, and at batch 32 where one request carries
64 stop strings of 256 characters (the most a request may have now; they never match), for two
versions of the code in the same run: a baseline (a git ref, checked out into a temporary worktree) and the working
tree, alternating A/B rounds in fresh processes; medians per round, then the median ratio.

    python benchmarks/step_overhead.py [--baseline REF] [--rounds 3]
    python benchmarks/step_overhead.py --worker      # one measurement of the code on sys.path
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# name -> (requests, output tokens, stop strings on the first request)
SCENARIOS = {"decode_b1": (1, 160, 0), "decode_b32": (32, 64, 0), "decode_b64": (64, 64, 0),
             "decode_b32_one_with_stops": (32, 64, 64)}


def worker() -> dict:
    import torch

    from conveyor import LLM, SamplingParams

    torch.set_num_threads(int(os.environ.get("STEP_BENCH_THREADS", "2")))
    llm = LLM(max_num_seqs=64, max_num_batched_tokens=2048, dtype="float32")
    engine = llm.engine
    model = engine.loaded.model
    in_forward = [0.0]
    forward = model.forward

    def timed_forward(*args, **kwargs):
        t = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            in_forward[0] += time.perf_counter() - t

    model.forward = timed_forward
    result = {}
    for name, (batch, out_len, num_stops) in SCENARIOS.items():
        stops = [f"<never {k}>" + "~" * 240 for k in range(num_stops)]
        for rep in range(2):    # the first round warms up (kernel build, allocator)
            for i in range(batch):
                engine.add_request([100 + (i * 37 + j * 11) % 30000 for j in range(32)],
                                   SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True,
                                                  stop=stops if i == 0 else None))
            overheads, steps = [], []
            while engine.has_unfinished_requests():
                in_forward[0] = 0.0
                t = time.perf_counter()
                engine.step()
                wall = time.perf_counter() - t
                steps.append(wall)
                overheads.append(wall - in_forward[0])
        # the first steps prefill; the rest are decodes of the whole batch
        decode = overheads[2:]
        result[name] = {"batch": batch, "steps": len(steps), "step_ms": 1e3 * statistics.median(steps[2:]),
                        "overhead_ms": 1e3 * statistics.median(decode),
                        "overhead_mean_ms": 1e3 * statistics.mean(decode)}
    return result


def run_worker(code_root: Path) -> dict:
    # One C++-extension build folder per tree: torch rebuilds an extension whose source path changed,
    # which alternating trees in one folder would do every round (minutes each).
    ext = Path(tempfile.gettempdir()) / "conveyor-bench-torch-ext" / str(code_root).strip("/").replace("/", "_")
    env = dict(os.environ, PYTHONPATH=str(code_root), TORCH_EXTENSIONS_DIR=str(ext))
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker"], env=env, check=True,
                         capture_output=True, text=True, cwd=code_root).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--baseline", default="437143b", help="git ref of the baseline code")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default="step_overhead")
    ap.add_argument("--baseline-tree", default=None,
                    help="an existing checkout of the baseline to use (kept); default: a temporary worktree")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker()))
        return
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import save

    with tempfile.TemporaryDirectory() as tmp:
        base = Path(args.baseline_tree) if args.baseline_tree else Path(tmp) / "base"
        if not args.baseline_tree:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.baseline],
                           check=True, capture_output=True)
        try:
            rounds = []
            for r in range(args.rounds):
                a, b = run_worker(base), run_worker(ROOT)
                print(f"round {r}: baseline {a}\n         current  {b}", flush=True)
                rounds.append({"baseline": a, "current": b})
        finally:
            if not args.baseline_tree:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=True)
    summary = {}
    for name in SCENARIOS:
        a = statistics.median(r["baseline"][name]["overhead_ms"] for r in rounds)
        b = statistics.median(r["current"][name]["overhead_ms"] for r in rounds)
        ratio = statistics.median(r["current"][name]["overhead_ms"] / r["baseline"][name]["overhead_ms"]
                                  for r in rounds)
        step_a = statistics.median(r["baseline"][name]["step_ms"] for r in rounds)
        step_b = statistics.median(r["current"][name]["step_ms"] for r in rounds)
        summary[name] = {"baseline_overhead_ms": a, "current_overhead_ms": b, "ratio": ratio,
                         "baseline_step_ms": step_a, "current_step_ms": step_b}
    line = ", ".join(f"{n}: {s['current_overhead_ms']:.2f} ms vs {s['baseline_overhead_ms']:.2f} ms at "
                     f"{args.baseline} ({s['ratio']:.2f}x; step {s['current_step_ms']:.1f} vs "
                     f"{s['baseline_step_ms']:.1f} ms)" for n, s in summary.items())
    save(args.name, {"baseline": args.baseline, "scenarios": {k: list(v) for k, v in SCENARIOS.items()},
                     "summary": summary, "rounds": rounds}, "per-step overhead (step - forward), " + line)


if __name__ == "__main__":
    main()
