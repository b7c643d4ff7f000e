"""Preemption study (simulator): the same preempting workloads under each preemption mode
(recompute, swap, auto) and victim choice (cost: priority, then cheapest to bring back;
latest: priority, then latest arrival, vLLM's rule), and under the scheduler before this
change (a git ref run in a worktree, its own defaults: latest arrival with a residency rule).

Reports per run: preemptions, blocks copied to host, tokens recomputed, TTFT/TPOT p50/p99 and
goodput under an SLO. Writes benchmarks/results/preemption_study.json and a line in
docs/benchmarks.md.

    python benchmarks/preemption_study.py [--baseline REF]
    python benchmarks/preemption_study.py --worker    # the runs of the code on sys.path, as JSON
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("recompute", "swap", "auto")
SLO = {"ttft_p99": 10.0, "tpot_p99": 0.5}


def workloads():
    from conveyor.sim.cost import StepCostModel
    from conveyor.sim.roofline import GPUS, MODEL_PRESETS, RooflineCostModel
    from conveyor.sim.workload import WorkloadSpec

    cpu = StepCostModel()   # the shipped CPU model (SmolLM2-135M fp32 on 2 cores), not this machine's profile
    h200 = RooflineCostModel(GPUS["h200"], MODEL_PRESETS["llama-3.1-8b"])
    return {
        # name: (cost model, KV blocks, host blocks, budget, workload, prefix caching)
        "cpu_mixed": (cpu, 150, 600, 1024, WorkloadSpec(num_requests=300, rate=0.9, prompt_len="16:512",
                                                         output_len="lognormal:60:1:1024", seed=11), False),
        "h200_long": (h200, 2000, 8000, 4096, WorkloadSpec(num_requests=300, rate=8, prompt_len="512:2048",
                                                            output_len="lognormal:200:1:2048", seed=7), False),
        # shared prefixes, priorities and a host pool too small for every victim
        "h200_prefix_prio": (h200, 500, 150, 4096, WorkloadSpec(
            num_requests=300, rate=16, prompt_len="256:1024", output_len="lognormal:200:1:2048",
            prefix_groups=6, prefix_len=768, prefix_share=0.7, priorities={0: 0.2, 1: 0.8}, seed=5), True),
    }


def worker() -> dict:
    import dataclasses

    from conveyor.scheduler.config import SchedulerConfig
    from conveyor.sim.simulator import simulate

    has_victims = any(f.name == "victim_policy" for f in dataclasses.fields(SchedulerConfig))
    out = {}
    for name, (cost, blocks, host, budget, spec, caching) in workloads().items():
        for mode in MODES:
            for victims in (("cost", "latest") if has_victims else ("before",)):
                kw = {"victim_policy": victims} if has_victims else {}
                cfg = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=budget, preemption_mode=mode,
                                      admission_policy="optimistic", **kw)
                res = simulate(spec.generate(), cfg, num_blocks=blocks, num_host_blocks=host, cost=cost,
                               prefix_caching=caching)
                s = res.summary(SLO)
                stats = res.stats if isinstance(res.stats, dict) else res.stats.as_dict()   # a baseline ref's: a dict
                out[f"{name}/{mode}/{victims}"] = {
                    "preemptions": s["num_preemptions"], "swaps": s["num_swaps_out"],
                    "blocks_copied": stats.get("blocks_swapped_out"),
                    "tokens_recomputed": s["recomputed_prompt_tokens"],
                    "ttft_p50": s["p50_ttft_s"], "ttft_p99": s["p99_ttft_s"],
                    "tpot_p50": s["p50_tpot_s"], "tpot_p99": s["p99_tpot_s"],
                    "goodput_req_s": s["goodput_req_s"], "sim_time_s": s["sim_time_s"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--baseline", default=None, help="git ref of the scheduler to compare with")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker()))
        return
    runs = worker()
    if args.baseline:
        with tempfile.TemporaryDirectory() as tmp:
            base = Path(tmp) / "base"
            subprocess.run(["git", "worktree", "add", "--detach", str(base), args.baseline], cwd=ROOT, check=True,
                           capture_output=True)
            try:
                done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "preemption_study.py"), "--worker"],
                                      cwd=base, capture_output=True, text=True, check=True,
                                      env={"PYTHONPATH": str(base), "PATH": "/usr/bin:/bin"})
                runs.update(json.loads(done.stdout.strip().splitlines()[-1]))
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=True)
    for key, r in sorted(runs.items()):
        print(f"{key:38s} preempt {r['preemptions']:5d} swaps {r['swaps']:5d} copied {r['blocks_copied']} "
              f"recomputed {r['tokens_recomputed']:7d} TTFT p50/p99 {r['ttft_p50']:.2f}/{r['ttft_p99']:.2f}s "
              f"TPOT p50/p99 {1e3 * r['tpot_p50']:.0f}/{1e3 * r['tpot_p99']:.0f}ms goodput {r['goodput_req_s']:.2f}")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import save

    best = {}
    for name in workloads():
        e2e = {m: runs[f"{name}/{m}/cost"]["sim_time_s"] for m in MODES}
        best[name] = {m: round(e2e[m] / min(e2e["swap"], e2e["recompute"]), 4) for m in MODES}
    line = "preemption study (simulator): makespan of each mode / the better of swap and recompute: " + "; ".join(
        f"{n} " + ", ".join(f"{m} {v:.3f}" for m, v in b.items()) for n, b in best.items())
    save("preemption_study", {"slo": SLO, "runs": runs, "makespan_vs_best_fixed_mode": best}, line)


if __name__ == "__main__":
    main()
