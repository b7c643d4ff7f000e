"""How far can a simulated latency percentile be trusted at a given load and sample size? The
simulator alone, on the cells of a `sim_calibration.py` result.

Issue 20's targets put the simulated TTFT/TPOT p50 within 15% of the real engine's. Two things move
a real run's percentiles that no cost model removes, and the simulator can measure both:

- **the machine's speed**: the same workload with every step cost 5% up and 5% down. The
  elasticity (relative change of a metric per relative change of the step cost;
  ``conveyor.sim.simulator.elasticity``, what ``conveyor simulate --sensitivity`` prints) says how
  accurate the step cost must be for a metric to land within a bound: at elasticity 3, a 15%
  bound needs the step cost within 5%, which a shared VM's drift from one minute to the next
  (docs/simulator.md: 5-25%) does not give;
- **timing noise**: the same requests (the same seeds: arrivals and lengths) with each step's cost
  multiplied by a random factor (lognormal, ``--jitter`` its sigma, median 1), ``--draws`` times.
  Near saturation a few milliseconds decide which step a request joins, and its percentiles
  wander; the spread between two such runs is the floor under any simulator's error on one run,
  as two real runs of the same requests show (``real_repeat`` in sim_calibration's rows). Also
  reported: the spread over other samples of the workload (other seeds, no jitter), the error a
  plan made on one sample of traffic has on the next.

Given a sim_calibration result: every cell of it (not the forced-preemption one, which runs a
small engine of its own) with its family, rate and seeds and the cost model it names, next to the
real runs' errors. Without one: every family of sim_calibration at ``--loads`` of its own simulated
saturation, ``--seeds`` runs of ``--requests`` a cell, on this machine's profile. Either way the
profile as sim_calibration prices its "profile" model (a saved correction taken off) and this
machine's engine knobs. Writes JSON and a line in docs/benchmarks.md. Simulation only (no model
runs but the engine's start; about a minute for six cells of 120 requests).

    python benchmarks/sim_sensitivity.py [results/sim_calibration_prefetch.json] [--loads 0.3,0.8]
        [--requests 60] [--seeds 2] [--jitter 0.1] [--draws 8] [--name sim_sensitivity]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from dataclasses import dataclass, fields, replace

from common import save
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
from conveyor.paths import profile_path
from conveyor.scheduler.costs import StepCostModel, StepShape
from conveyor.sim.simulator import SENSITIVITY_STEP, elasticity, engine_knobs, simulate
from conveyor.sim.workload import WorkloadSpec
from sim_calibration import FAMILIES, METRICS, base, family_saturation, pooled


@dataclass
class Jittered(StepCostModel):
    """A cost model whose every step takes its price times a lognormal factor of median 1."""
    sigma: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        StepCostModel.__post_init__(self)
        self._rng = random.Random(f"jitter/{self.seed}")

    def shape_time(self, s: StepShape) -> float:
        return StepCostModel.shape_time(self, s) * self._rng.lognormvariate(0.0, self.sigma)


def jittered(cost: StepCostModel, sigma: float, seed: int) -> Jittered:
    return Jittered(**{f.name: getattr(cost, f.name) for f in fields(StepCostModel)}, sigma=sigma, seed=seed)


def spread(values: list[dict], ref: dict) -> dict:
    """Per metric: the standard deviation of `values` and their largest deviation, relative to `ref`."""
    return {m: {"sd": statistics.stdev(v[m] for v in values) / ref[m],
                "max": max(abs(v[m] / ref[m] - 1) for v in values)} for m in METRICS}


def mean_of(values: list[dict]) -> dict:
    return {m: statistics.fmean(v[m] for v in values) for m in METRICS}


def cell(specs: list[WorkloadSpec], cost: StepCostModel, knobs: dict, sigma: float, draws: int) -> dict:
    def run(specs, cost_of) -> dict:
        return pooled([simulate(spec.generate(), cost=cost_of(spec), seed=spec.seed, **knobs) for spec in specs])

    ref = run(specs, lambda spec: cost)
    noisy = [run(specs, lambda spec: jittered(cost, sigma, 1000 * k + spec.seed)) for k in range(draws)]
    others = [run([replace(spec, seed=spec.seed + 1000 * (k + 1)) for spec in specs], lambda spec: cost)
              for k in range(draws)]
    return {"simulated": ref,
            "elasticity": elasticity(lambda c: run(specs, lambda spec: c), cost, ref),
            "jitter": spread(noisy, ref), "other_samples": spread(others, mean_of(others))}


def cells_of_result(path: str) -> tuple[str, int, list]:
    """The cost model, requests per run and cells (name, specs, own load, the real runs' numbers) of a
    sim_calibration result."""
    result = json.load(open(path))
    n = result["workload"]["num_requests"]
    cells = []
    for row in result["families"]:
        family = row["family"].rsplit(", ", 1)[0]
        if family not in FAMILIES:
            continue
        specs = [WorkloadSpec(**{**base(n), **FAMILIES[family], "rate": row["rate"], "seed": seed})
                 for seed in row["seeds"]]
        own = row["rate"] / row["saturation_req_s"] if row.get("saturation_req_s") else None
        cells.append((row["family"], specs, own, {"real_repeat": row.get("real_repeat"),
                                                   "profile_error": row.get("profile")}))
    return result["cost_model"], n, cells


def cells_of_loads(cost: StepCostModel, knobs: dict, n: int, seeds: int, loads: list[float]) -> list:
    """Every family at each load of its own simulated saturation, `seeds` runs of n requests a cell
    (seeds 21, 121, ...: sim_calibration.py's for its first cell)."""
    cells = []
    for name, family in FAMILIES.items():
        saturation = family_saturation(family, n, cost, knobs)
        for load in loads:
            specs = [WorkloadSpec(**{**base(n), **family, "rate": load * saturation, "seed": 21 + 100 * j})
                     for j in range(seeds)]
            cells.append((f"{name}, {int(100 * load)}%", specs, load, {}))
    return cells


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("result", nargs="?", help="a sim_calibration.py result JSON (its cells, cost model and sizes)")
    ap.add_argument("--loads", default="0.3,0.8", help="without a result: loads of each family's own saturation")
    ap.add_argument("--requests", type=int, default=60, help="without a result: requests per run")
    ap.add_argument("--seeds", type=int, default=2, help="without a result: runs per cell, pooled")
    ap.add_argument("--jitter", type=float, default=0.1, help="sigma of the per-step lognormal cost factor")
    ap.add_argument("--draws", type=int, default=8, help="jittered runs (and other samples) per cell")
    ap.add_argument("--name", default="sim_sensitivity", help="results JSON name")
    args = ap.parse_args()
    engine = Engine(EngineConfig.from_options(max_num_seqs=32, max_num_batched_tokens=1024, cost_model="none"))
    knobs = engine_knobs(engine)
    if args.result:
        path, n, cells = cells_of_result(args.result)
    else:
        path, n = str(profile_path(engine.model_name, engine.dtype)), args.requests
    # as sim_calibration prices its "profile" model: a correction saved by `profile --sustained` taken off
    cost = replace(StepCostModel.load(path), decode_scales=[], prefill_scales=[], between_steps=0.0)
    if not args.result:
        cells = cells_of_loads(cost, knobs, n, args.seeds, [float(x) for x in args.loads.split(",")])
    rows = []
    for name, specs, own, real in cells:
        out = {"family": name, "rate": specs[0].rate, "requests": n * len(specs), "own_load": own,
               **cell(specs, cost, knobs, args.jitter, args.draws), **real}
        rows.append(out)
        print(name, {k: {m: round(v, 3) if not isinstance(v, dict) else {a: round(b, 3) for a, b in v.items()}
                         for m, v in out[k].items()} for k in ("elasticity", "jitter", "other_samples")}, flush=True)

    def pct(x: float) -> str:
        return f"{100 * x:.0f}%"

    line = f"{rows[0]['requests']} requests per cell, step cost +-{pct(SENSITIVITY_STEP)}, " \
        f"per-step jitter sigma {args.jitter} ({args.draws} draws): " + "; ".join(
            f"{r['family']}: TTFT / TPOT p50 elasticity {r['elasticity']['ttft_p50']:.1f} / "
            f"{r['elasticity']['tpot_p50']:.1f}, jitter sd {pct(r['jitter']['ttft_p50']['sd'])} / "
            f"{pct(r['jitter']['tpot_p50']['sd'])}, other samples sd {pct(r['other_samples']['ttft_p50']['sd'])} / "
            f"{pct(r['other_samples']['tpot_p50']['sd'])}" for r in rows)
    save(args.name, {"source": args.result, "cost_model": path, "step": SENSITIVITY_STEP, "jitter": args.jitter,
                     "draws": args.draws, "rows": rows}, line)


if __name__ == "__main__":
    main()
