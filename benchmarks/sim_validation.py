"""Is the simulator right? The same workloads on the real engine and in the simulator.

The cost model is this machine's profile (`conveyor profile`, run first if missing). Four
workloads, each run on the real engine (its core and ModelRunner in real time, through the same
driver as the simulator, requests ending at their drawn output lengths) and then simulated:

- light (30% of the saturation rate), near saturation (90%), overloaded (150%);
- forced preemption: a KV cache too small for the batch, optimistic admission, overloaded.

The saturation rate is the simulator's throughput with every request at once. Reported per
level: output throughput, TTFT p50, TPOT p50 and preemptions, real vs simulated, with the
relative error; the issue's bars are 10%, 15%, 15%, 20%. Writes JSON, a line in
docs/benchmarks.md and docs/img/sim_validation.png (real and simulated timelines of one level).

    python benchmarks/sim_validation.py [--requests 60] [--quick]
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from common import ROOT, save
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
from conveyor.paths import profile_path
from conveyor.plot import plot_traces
from conveyor.profile import profile
from conveyor.sim.cost import StepCostModel
from conveyor.sim.harness import run_on_engine
from conveyor.sim.simulator import SimResult, engine_knobs, saturation_rate, simulate
from conveyor.sim.workload import WorkloadSpec

BARS = {"output_tok_s": 0.10, "p50_ttft_s": 0.15, "p50_tpot_s": 0.15, "num_preemptions": 0.20}


def rel_error(sim: float, real: float) -> float:
    return (sim - real) / real if real else (0.0 if sim == real else math.inf)


def compare(engine: Engine, cost: StepCostModel, spec: WorkloadSpec) -> dict:
    workload = spec.generate()
    preempted = engine.stats().num_preemptions
    t = time.perf_counter()
    records, trace = run_on_engine(engine, workload, seed=spec.seed)
    wall = time.perf_counter() - t
    stats = engine.stats()
    real = SimResult(records, stats, [trace], block_size=engine.config.block_size)
    sim = simulate(workload, cost=cost, trace=True, seed=spec.seed, **engine_knobs(engine))
    r, s = real.summary(), sim.summary()
    r["num_preemptions"] = stats.num_preemptions - preempted   # the engine's counters are cumulative
    row = {"rate": spec.rate, "requests": len(workload), "wall_s": wall}
    for key in BARS:
        row[key] = {"real": r[key], "sim": s[key], "rel_error": rel_error(s[key], r[key])}
    return {"row": row, "real": real, "sim": sim}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--quick", action="store_true", help="fewer requests, for a smoke run")
    args = ap.parse_args()
    n = 16 if args.quick else args.requests
    base = dict(max_num_seqs=32, max_num_batched_tokens=1024, cost_model="none")
    engine = Engine(EngineConfig.from_options(**base))
    path = profile_path(engine.model_name, engine.config.dtype)
    if path.is_file():
        cost = StepCostModel.load(path)
    else:
        cost = profile(engine)
        cost.save(path)
    print(f"cost model: {path}", flush=True)
    spec = dict(num_requests=n, prompt_len="32:256", output_len="16:128")
    saturation = saturation_rate(WorkloadSpec(**spec, seed=100).generate(), cost, **engine_knobs(engine))
    print(f"saturation ~ {saturation:.2f} req/s (simulated)", flush=True)
    levels = [("light", engine, 0.3, 1), ("near saturation", engine, 0.9, 2), ("overloaded", engine, 1.5, 3)]
    small = Engine(EngineConfig.from_options(**{**base, "num_kv_blocks": 40, "admission_policy": "optimistic",
                                                "min_resident_steps": 2}), loaded=engine.loaded)
    levels.append(("forced preemption", small, 1.5, 4))
    rows, runs = [], {}
    for name, eng, frac, seed in levels:
        out = compare(eng, cost, WorkloadSpec(**spec, rate=frac * saturation, seed=seed))
        row = out["row"]
        row["level"] = name
        rows.append(row)
        runs[name] = out
        print(name, {k: (v if not isinstance(v, dict) else {kk: round(vv, 4) for kk, vv in v.items()})
                     for k, v in row.items()}, flush=True)
    shown = "forced preemption"
    img = plot_traces([runs[shown]["real"].traces[0], runs[shown]["sim"].traces[0]],
                      [f"real engine ({shown})", f"simulator ({shown})"], ROOT / "docs" / "img" / "sim_validation.png")
    print(img)

    def pct(x: float) -> str:
        return f"{100 * x:+.0f}%" if math.isfinite(x) else "inf"

    line = "; ".join(f"{r['level']} ({r['rate']:.2f}/s): tok/s {pct(r['output_tok_s']['rel_error'])}, "
                     f"TTFT p50 {pct(r['p50_ttft_s']['rel_error'])}, TPOT p50 {pct(r['p50_tpot_s']['rel_error'])}, "
                     f"preemptions {r['num_preemptions']['real']}->{r['num_preemptions']['sim']}" for r in rows)
    save("sim_validation", {"cost_model": str(path), "cost_meta": {k: v for k, v in cost.meta.items() if k != "samples"},
                            "saturation_req_s": saturation, "workload": spec, "bars": BARS, "levels": rows},
         "simulated vs real (relative error of the simulation): " + line)


if __name__ == "__main__":
    sys.exit(main())
