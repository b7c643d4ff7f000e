"""Per-step scheduling cost: microseconds (the thread's CPU time, so that time the VM spends
descheduled does not count) of Scheduler.schedule() + update() per step, at 64 and
256 running requests, with a queue of waiting requests behind them, for two versions of the
code in the same run (a baseline git ref checked out into a temporary worktree, and the working
tree), alternating A/B rounds in fresh processes; medians per round, then the median ratio. On the
shared 2-core machines the same code runs at two speeds about 2x apart from one process to
the next (CPU time too), so use many rounds and read the per-round ratios in the JSON.

No model and no executor: sampled tokens come from a counter, so only the scheduler and the KV
cache manager are timed. Every request runs for the whole measurement (ignore_eos, long
max_tokens) under optimistic admission with room for all, so the batch stays full at its size
in both versions and the contexts grow step by step.

    python benchmarks/sched_cost.py [--baseline REF] [--rounds 5]
    python benchmarks/sched_cost.py --worker      # one measurement of the code on sys.path
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = (64, 256)
STEPS = 300


def worker() -> dict:
    # the least of three runs: on shared cores a run is only ever slowed down by its neighbours
    return {f"running_{n}": min(one_run(n) for _ in range(3)) for n in SIZES}


def one_run(n: int) -> float:
    """Median microseconds per step with n requests running (after the prefill steps)."""
    from conveyor.kv.manager import KVCacheManager
    from conveyor.request import Request
    from conveyor.sampling.params import SamplingParams
    from conveyor.scheduler.config import SchedulerConfig
    from conveyor.scheduler.output import ModelOutput
    from conveyor.scheduler.scheduler import Scheduler

    # optimistic admission: the batch is full at n in both versions (the predictive prior changed)
    cfg = SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=max(2048, 2 * n), admission_policy="optimistic")
    kv = KVCacheManager(num_blocks=n * 40, block_size=16, num_host_blocks=n * 8)
    sched = Scheduler(cfg, kv)
    params = SamplingParams(max_tokens=100_000, ignore_eos=True, temperature=0)
    for i in range(n + n // 4):   # a quarter more than fits in the batch: a queue stays behind
        sched.add_request(Request(f"r{i}", [1 + (i * 31 + j) % 5000 for j in range(64)], params, seed=i))
    token = 0
    times, seqs = [], []
    gc.collect()
    gc.disable()   # a cyclic collection landing in one version's steps and not the other's is noise here
    for _ in range(STEPS):
        t0 = time.thread_time()
        plan = sched.schedule()
        sampled = [s.request_id for s in plan.scheduled if s.sample]
        k = len(sampled)
        sched.update(plan, model_output(ModelOutput, sampled, token))
        times.append(time.thread_time() - t0)
        seqs.append(len(plan.scheduled))
        token += k
    gc.enable()
    assert min(seqs[STEPS // 3:]) == n, "the batch must stay full"
    return statistics.median(times[STEPS // 3:]) * 1e6   # past the prefill steps


def model_output(cls, sampled: list[str], token: int):
    """Tokens from a counter, in the ModelOutput of the code under test: keyed by request id, or (a
    baseline from before that contract) a list in scheduling order."""
    if "sampled" in cls.__dataclass_fields__:
        return cls({rid: token + i for i, rid in enumerate(sampled)})
    return cls(list(range(token, token + len(sampled))))


def run_worker(tree: Path) -> dict:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sched_cost.py"), "--worker"],
                         cwd=tree, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--baseline", default="HEAD")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker()))
        return
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.baseline], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            rounds = []
            for _ in range(args.rounds):
                rounds.append({"baseline": run_worker(base), "current": run_worker(ROOT)})
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=True)
    summary = {}
    for key in rounds[0]["current"]:
        b = statistics.median(r["baseline"][key] for r in rounds)
        c = statistics.median(r["current"][key] for r in rounds)
        ratio = statistics.median(r["current"][key] / r["baseline"][key] for r in rounds)
        summary[key] = {"baseline_us": round(b, 1), "current_us": round(c, 1), "ratio": round(ratio, 3)}
        print(f"{key}: baseline {b:.0f} us, current {c:.0f} us per step, ratio {ratio:.3f}")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import save

    line = f"scheduling cost per step (schedule + update, no model) vs {args.baseline}: " + ", ".join(
        f"{k.replace('running_', '')} running {v['baseline_us']:.0f} -> {v['current_us']:.0f} us ({v['ratio']:.2f}x)"
        for k, v in summary.items())
    save("sched_cost", {"baseline": args.baseline, "steps": STEPS, "summary": summary, "rounds": rounds}, line)


if __name__ == "__main__":
    main()
