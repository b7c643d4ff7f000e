"""A finished `sim_calibration.py` result simulated again with its speed checks applied to its profile,
the checks taken against either reference: which one predicts the real runs?

Every real run of `sim_calibration.py` has a speed check just before it (each probe step's ratio,
``speed_by_tokens``). A check's ratios can be taken against the probe steps' own times at the
profile's end (``meta.probe``, how checks compared until 2026-12-06) or against what the profile's fit
prices the same shapes at (`conveyor.profile.probe_reference`, since); the two differ by the ratio of
those references, which the profile has. For each family and load this simulates the result's
workloads (the same specs and seeds) with the profile as it is and scaled by each run's check, by the
median ratio (``--recheck --rescale --rescale-by median``) and by size (``--rescale``,
``StepCostModel.scaled(factor, by_tokens)``), under both references, and compares with the real
runs' percentiles saved in the result. With ``--traces`` (the result's ``--traces`` folder) it also
prices the runs' steps. No real runs: seconds per cell.

The profile is the one whose probe times are those of the result's check at calibration, found in
``--profiles`` (default ``results/profiles``).

    python benchmarks/sim_recheck.py results/sim_calibration_x.json [--profiles DIR] [--traces DIR] [--name NAME]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from common import RESULTS, save
from sim_calibration import FAMILIES, METRICS, base, relative, summary_text, tally, within
from speed_checks import both_references, load_profiles, probe_over_fit, profile_of
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
from conveyor.engine.trace import StepTracer
from conveyor.sim.cost import StepCostModel
from conveyor.sim.simulator import engine_knobs, simulate
from conveyor.sim.validate import runs_step_errors, traced_steps
from conveyor.sim.workload import WorkloadSpec

MODELS = ("profile", "probe, median", "probe, by size", "fit, median", "fit, by size")


def result_and_profile(result_path: str, profiles: str) -> tuple[dict, Path, StepCostModel]:
    """A sim_calibration result, and the profile in `profiles` its checks were made against (as the
    result used it: any trace correction taken off)."""
    result = json.loads(Path(result_path).read_text())
    found = profile_of(result, load_profiles(Path(profiles)))
    if found is None:
        raise SystemExit(f"no profile in {profiles} is the reference of this result's check")
    return result, found[0], replace(found[1], decode_scales=[], prefill_scales=[], between_steps=0.0)


def engines(result: dict) -> tuple[Engine, Engine]:
    """Engines like the result's: the families' and the forced-preemption cell's small one (same weights)."""
    threads = {"torch_threads": result["torch_threads"]} if result.get("torch_threads") else {}
    options = dict(max_num_seqs=32, max_num_batched_tokens=1024, cost_model="none", **threads)
    engine = Engine(EngineConfig.from_options(**options))
    return engine, Engine(EngineConfig.from_options(**options, num_kv_blocks=40, admission_policy="optimistic",
                                                    min_resident_steps=2), loaded=engine.loaded)


def cell(result: dict, row: dict, engine: Engine, small: Engine, traces: str | None) -> tuple[Engine, list, list]:
    """A result row's engine, its workloads (one per seed) and, from `traces` (the result's ``--traces``
    folder) where saved, its real runs' steps."""
    name = row["family"]
    family = next((knobs for key, knobs in FAMILIES.items() if name.startswith(key)), {})
    specs = [WorkloadSpec(**{**base(result["workload"]["num_requests"]), **family, "rate": row["rate"],
                             "seed": seed}) for seed in row["seeds"]]
    files = [Path(traces) / f"{re.sub(r'[^A-Za-z0-9]+', '-', name).strip('-')}_seed{spec.seed}.json"
             for spec in specs] if traces else []
    steps = [traced_steps(StepTracer.load(f)) for f in files if f.is_file()]
    return (small if name.startswith("forced") else engine), specs, steps


def judged(specs: list, eng: Engine, costs: list[StepCostModel], real: dict, steps: list) -> dict:
    """A cell simulated with one cost model per run: each metric's error against the real runs' and,
    with every run's steps, the error of the models' prices of them."""
    rel = relative([simulate(spec.generate(), cost=c, seed=spec.seed, **engine_knobs(eng))
                    for spec, c in zip(specs, costs)], real)
    if steps and len(steps) == len(specs):
        report = runs_step_errors(list(zip(steps, costs)))
        rel["step_error"], rel["step_buckets"] = report["all"]["error"], report["buckets"]
    return rel


def resimulate(result: dict, pair: tuple[Engine, Engine], traces: str | None,
               per_run: Callable[[dict], list[dict[str, StepCostModel]]]) -> tuple[list[dict], dict]:
    """Every cell of `result` simulated again under each model `per_run(row)` gives (by label, one
    dict per real run of the cell), against the real runs' percentiles as saved; with `traces`, the
    models' prices of the runs' steps too. Returns the cells' errors and, per model over the cells
    within the targets' range, `tally`'s counts (p50 targets, every target, step cost within 10% in
    every shape bucket) and mean absolute step error."""
    engine, small = pair   # as `engines` makes them
    rows = []
    for row in result["families"]:
        eng, specs, steps = cell(result, row, engine, small, traces)
        models = per_run(row)
        out = {"family": row["family"]}
        for label in models[0]:
            out[label] = judged(specs, eng, [m[label] for m in models], row["real"], steps)
        rows.append(out)
        print(f"{row['family']:28s}", " | ".join(f"{m}: " + " ".join(f"{100 * out[m][k]:+.0f}" for k in METRICS)
                                                 for m in models[0]), flush=True)
    summary = {m: tally([r[m] for r in within(rows)]) for m in rows[0] if m != "family"}
    print(summary, flush=True)
    return rows, summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("result", help="a sim_calibration result JSON")
    ap.add_argument("--profiles", default=str(RESULTS / "profiles"), help="where the result's profile is")
    ap.add_argument("--traces", help="the result's --traces folder (prices the real runs' steps)")
    ap.add_argument("--name", help="results JSON name (default: sim_recheck_<result's name>)")
    args = ap.parse_args()
    result, path, cost = result_and_profile(args.result, args.profiles)
    print(f"profile: {path}", flush=True)
    to_fit = probe_over_fit(cost)
    stored_fit = result.get("speed_reference") == "fit"

    def models(sizes: dict[str, float]) -> dict[str, StepCostModel]:
        out = {"profile": cost}
        for ref, rs in both_references(sizes, to_fit, stored_fit).items():
            factor = statistics.median(rs.values())
            out[f"{ref}, median"], out[f"{ref}, by size"] = cost.scaled(factor), cost.scaled(factor, rs)
        return out

    rows, summary = resimulate(result, engines(result), args.traces,
                               lambda row: [models(sizes) for sizes in row["speed_by_tokens"]])

    stem = Path(args.result).stem
    save(args.name or f"sim_recheck_{stem}", {"result": args.result, "profile": str(path),
                                               "probe_over_fit": to_fit, "families": rows, "summary": summary},
         f"{stem} simulated again with each run's speed check applied to its profile: cells meeting every "
         f"target of {len(within(rows))} (p50s): " + ", ".join(summary_text(summary, m) for m in MODELS))


if __name__ == "__main__":
    sys.exit(main())
