"""Does a correction fitted from one real run's step trace make the simulator right on other workloads?

The cost model is this machine's profile (`conveyor profile`, run first if missing). The
calibration is what `conveyor profile --sustained` adds (`conveyor.sim.validate.
sustained_calibration`): a short sustained run (uniform prompts 32-256 and outputs 16-128, Poisson
at 70% of the simulated saturation rate) through the real engine with a step trace, the correction
fitted on half of its steps and reported on the other half. Then workload families that were not
in the fit run on the real engine and in the simulator, with the profile as it is and with the
corrected one, each at light load (30% of its simulated saturation) and near it (80%). The saturation is
each family's own (``--load-of family``, the default since 2026-12-06: the rate at which the simulated engine
completes that family's requests all arriving at once); before, every family ran at fractions of the uniform
workload's (``--load-of uniform``), which overloaded the long-prompt family even at "30%" (TTFT p50 40 s: a
queue, not a step cost) and left the heavy-tailed and shared-prefix ones far from saturation at "80%". And
the saturation is the one at the machine's speed when the cell starts (``--load-at checked``, the default
since 2026-12-06, late: the profile scaled by a speed check just before the cell, as the "checked" model
below); with ``--load-at profile`` it is the profile's as made, which put four "80%" cells of run 12 at
88-101% of the capacity measured during them, beyond the targets' range, when the machine had slowed:

- uniform (the calibration's distributions, other seeds);
- heavy-tailed outputs (lognormal, median 32, up to 400);
- bursty arrivals (gamma, CV 3);
- shared prefixes (4 groups, 128-token prefixes, prefix caching on);
- long prompts (600-1500 tokens, chunked under the 1024-token budget);
- and forced preemption (a 40-block KV cache, optimistic admission, overloaded at 150%).

A third model, "checked", is the profile scaled by a speed check just before each run (``conveyor
profile --recheck``: the profile's probe steps timed again against what its fit prices them at; by
default each probe's ratio, interpolated over the step-cost curve by step size, as ``--recheck
--rescale`` applies it; ``--check median`` their median ratio, as ``--rescale-by median``): how much of
the error is this shared machine's drift from the profile to the run. (Until 2026-12-06 it was the
corrected model scaled by the check's ratio to the check at the calibration, and the checks compared
with the probes' times at the profile.) Each check times the probes in ``--check-rounds`` rounds (3 by
default since run 14; every round's times saved, for `check_rounds.py`) and takes each probe's median.

A fourth model, "recent", follows the machine the way a server could: the profile corrected on the step
traces of the last few real runs (``--recent N``, default 4: the two cells before, at two seeds), as
``conveyor simulate --validate A.json B.json --calibrate`` pools a server's recent traces. The cells run
by load (every family at 30%, then every family at 80%), so those runs are always other families; the
first cell gets the calibration run's correction.

A fifth, "own", is not a prediction but a diagnostic: the profile corrected on the step traces of the
cell's own real runs (fitted on half their steps, as `calibrate` does), so the step costs are this very
run's (machine speed included). What error is left with it is the simulator's (its scheduling model,
and what a per-bucket factor cannot say about single steps); the difference between the profile's error
and this one is what the step-cost prediction costs.

Near saturation (80%) the short-prompt families run a second time on the real engine: the difference
between two real runs of one workload is the floor under the simulator's error at this sample size
(`repeat_floor.py` gathers these repeats over results).

Reported per family and load: TTFT and TPOT p50 / p90 and throughput, real vs simulated (relative
error), preemptions, the step-cost error of the run's own trace under the five models (overall
and per shape bucket, each run's steps priced by its own model; for "checked" since run 16), and the
load as a fraction of the capacity the machine had during the runs (``measured_load``: the rate over
the family's saturation under the "own" model; issue 20's targets are for loads up to 85% of measured
capacity). Per model, over the cells the targets are for (all but forced preemption), ``summary``
counts the cells meeting the p50 targets, every target, and every bucket of 20 steps or more within
10%. With ``--seeds K`` every family and load runs K
times, each with requests of its own (a speed check before each), and the metrics are taken over the
K runs' requests together: K times the sample without one run lasting K times as long. Writes JSON and a line in
docs/benchmarks.md.

``--torch-threads N`` runs the engines with N torch threads, against a profile of their own (made if
missing): on the 2-vCPU Zen4, one thread held its speed where two did not (machine_steadiness.py).

    python benchmarks/sim_calibration.py [--requests 60] [--seeds 1] [--check median|by-size] [--name NAME]
                                         [--load-of family|uniform] [--load-at checked|profile] [--check-rounds N]
                                         [--torch-threads N] [--profile PATH] [--traces DIR]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from common import save
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
from conveyor.paths import profile_path
from conveyor.profile import profile, speed_check
from conveyor.sim.cost import StepCostModel
from conveyor.sim.harness import run_on_engine
from conveyor.sim.simulator import SimResult, engine_knobs, saturation_rate, simulate
from conveyor.sim.validate import (buckets_within, calibrate, runs_step_errors, step_errors, sustained_calibration,
                                   traced_steps)
from conveyor.sim.workload import WorkloadSpec

MODELS = ("profile", "corrected", "checked", "recent", "own")
# The workload families (knobs over `base(n)`); the forced-preemption cell runs on an engine of its own.
FAMILIES = {"uniform": {}, "heavy-tailed outputs": dict(output_len="lognormal:32:1.0:400"),
            "bursty (gamma CV 3)": dict(arrival="gamma:3"), "shared prefixes": dict(prefix_groups=4, prefix_len=128),
            "long prompts": dict(prompt_len="600:1500")}


def base(n: int) -> dict:
    """The uniform workload of n requests, every family's starting point."""
    return dict(num_requests=n, prompt_len="32:256", output_len="16:128")


def family_saturation(family: dict, n: int, cost: StepCostModel, sim_knobs: dict) -> float:
    """A family's saturation in the simulator (req/s): n of its requests (seed 100) arriving at once."""
    return saturation_rate(WorkloadSpec(**{**base(n), **family}, seed=100).generate(), cost, **sim_knobs)
METRICS = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "throughput")


def real_run(engine: Engine, spec: WorkloadSpec) -> tuple[SimResult, object, float]:
    workload = spec.generate()
    t = time.perf_counter()
    records, trace = run_on_engine(engine, workload, seed=spec.seed)
    return SimResult(records, engine.stats(), [trace], block_size=engine.config.block_size), trace, \
        time.perf_counter() - t


def pooled(results: list[SimResult]) -> dict[str, float]:
    """The metrics over the requests of several runs taken together: percentiles over all their
    requests, throughput as all their output tokens over the sum of their durations."""
    union = SimResult([r for res in results for r in res.records], results[0].stats)
    out = {m: union.metric(m) for m in METRICS if m != "throughput"}
    out["throughput"] = sum(r.output_tokens for r in results) / sum(r.sim_time for r in results)
    return out


def relative(sims: list[SimResult], real: dict[str, float]) -> dict[str, float]:
    sim = pooled(sims)
    return {**{m: sim[m] / real[m] - 1 for m in METRICS},
            "preemptions": sum(r.stats.num_preemptions for r in sims)}


def met(rel: dict) -> tuple[bool, bool]:
    """(TTFT and TPOT p50 within 15%, every target: p90s within 25% and throughput within 5% too)."""
    p50 = abs(rel["ttft_p50"]) <= 0.15 and abs(rel["tpot_p50"]) <= 0.15
    return p50, p50 and abs(rel["ttft_p90"]) <= 0.25 and abs(rel["tpot_p90"]) <= 0.25 and abs(rel["throughput"]) <= 0.05


def targeted(row: dict) -> bool:
    """Whether issue 20's targets are for this cell: all but the forced-preemption one, beyond saturation."""
    return "150%" not in row["family"]


def within(rows: list[dict]) -> list[dict]:
    """The cells issue 20's targets are for."""
    return [row for row in rows if targeted(row)]


def tally(rels: list[dict]) -> dict:
    """One model's errors over cells (`relative`'s, with ``step_error`` and ``step_buckets`` where its
    prices of the real steps are known): how many cells met the p50 targets, how many every target,
    in how many every shape bucket's step cost was within 10% (`buckets_within`), the mean absolute
    step error."""
    steps = [abs(r["step_error"]) for r in rels if "step_error" in r]
    buckets = [buckets_within(r["step_buckets"]) for r in rels if "step_buckets" in r]
    return {"p50": sum(met(r)[0] for r in rels), "every": sum(met(r)[1] for r in rels),
            "buckets_within": sum(buckets) if buckets else None,
            "mean_abs_step_error": statistics.fmean(steps) if steps else None}


def summary_text(summary: dict, label: str) -> str:
    """One model's line in docs/benchmarks.md: cells meeting every target (the p50s, the step error,
    the cells whose every bucket of >= 20 steps was within 10%)."""
    s = summary[label]
    step = f", step {100 * s['mean_abs_step_error']:.1f}%" if s["mean_abs_step_error"] is not None else ""
    buckets = f", buckets {s['buckets_within']}" if s.get("buckets_within") is not None else ""
    return f"{label} {s['every']} ({s['p50']} p50s{step}{buckets})"


def rescaled(model: StepCostModel, check: dict, by_size: bool) -> StepCostModel:
    """The profile `model` at the speed the check `check` measured: by the median ratio (as ``profile
    --recheck --rescale --rescale-by median``), or with `by_size` by each probe step's ratio over the
    step-cost curve by size (as ``--rescale``)."""
    return model.scaled(check["factor"] or 1.0, check["by_tokens"] if by_size else None)


def family_row(name: str, eng: Engine, knobs: dict, base_knobs: dict, saturation: float, cost: StepCostModel,
               corrected: StepCostModel, recent: StepCostModel, seeds: list[int],
               by_size: bool, traces_dir: Path | None = None, first_check: dict | None = None,
               rounds: int = 1) -> tuple[dict, list]:
    """One workload family at one load, run once per seed on the real engine (a speed check before
    each run; `first_check`, the one the cell's rate was set by, stands for the first) and in the simulator
    under the five models; errors of the metrics pooled over the seeds. Also returns the real runs' step
    traces."""
    specs = [WorkloadSpec(**{**base_knobs, **knobs, "seed": seed}) for seed in seeds]
    preempted = eng.stats().num_preemptions
    reals, steps, walls, checks, traces = [], [], [], [], []
    for i, spec in enumerate(specs):
        # Just before the run, against what the profile's fit prices the probe steps at.
        checks.append(first_check if i == 0 and first_check is not None else speed_check(eng, cost, rounds=rounds))
        eng.core.scheduler.kv.reset_prefix_cache()   # as each simulation starts: nothing cached by runs before
        real, trace, wall = real_run(eng, spec)
        reals.append(real)
        walls.append(wall)
        steps.append(traced_steps(trace))
        traces.append(trace)
        if traces_dir is not None:   # for `conveyor simulate --validate` and later analysis
            trace.save(traces_dir / f"{re.sub(r'[^A-Za-z0-9]+', '-', name).strip('-')}_seed{spec.seed}.json")
    real = pooled(reals)
    own, _ = calibrate(traces, cost)   # not a prediction: the step costs of these very runs
    # The load as a fraction of the capacity the machine had during these runs: the family's
    # saturation under their own step costs (the targets hold up to 85% of measured capacity).
    family = {k: v for k, v in knobs.items() if k != "rate"}
    measured = family_saturation(family, base_knobs["num_requests"], own, engine_knobs(eng))
    models = {"profile": [cost] * len(specs), "corrected": [corrected] * len(specs),
              "checked": [rescaled(cost, check, by_size) for check in checks],
              "recent": [recent] * len(specs), "own": [own] * len(specs)}
    speeds = [c["factor"] or 1.0 for c in checks]
    row = {"family": name, "rate": specs[0].rate, "saturation_req_s": saturation, "seeds": seeds,
           "requests": sum(len(r.records) for r in reals),
           "measured_saturation_req_s": measured, "measured_load": knobs["rate"] / measured,
           "wall_s": sum(walls), "speed_factor": statistics.median(speeds), "speed_factors": speeds,
           "speed_by_tokens": [c["by_tokens"] for c in checks],
           "speed_checks": [{"then_s": c["then_s"], "rounds_s": c["rounds_s"]} for c in checks],
           "real": {**real, "preemptions": eng.stats().num_preemptions - preempted}}
    for label, costs in models.items():
        row[label] = relative([simulate(spec.generate(), cost=c, seed=spec.seed, **engine_knobs(eng))
                               for spec, c in zip(specs, costs)], real)
    for label, costs in models.items():   # each run's steps priced by its model, all runs' steps in one report
        report = runs_step_errors(list(zip(steps, costs)))
        row[f"step_error_{label}"] = {"steps": report["all"]["steps"], "error": report["all"]["error"],
                                      "per_run": [step_errors(run, c)["all"] for run, c in zip(steps, costs)],
                                      "buckets": report["buckets"]}   # for "checked" since run 16
    if 0.5 < knobs["rate"] / saturation < 1 and "long" not in name:
        # The same workloads on the real engine again: how far one run's percentiles are from the
        # next one's (the floor under any simulator's error at this sample size). The first run's
        # prompts are in the prefix cache: forgotten, or every prompt of the second run would hit.
        again = []
        for spec in specs:
            eng.core.scheduler.kv.reset_prefix_cache()
            again.append(real_run(eng, spec)[0])
        row["real_repeat"] = {m: v for m, v in relative(again, real).items() if m != "preemptions"}
    return row, traces


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--seeds", type=int, default=1,
                    help="runs per family and load, each with its own requests; metrics pooled over them")
    ap.add_argument("--name", default="sim_calibration", help="results JSON name")
    ap.add_argument("--load-of", choices=("family", "uniform"), default="family",
                    help="loads as fractions of each family's own simulated saturation, or of the uniform workload's")
    ap.add_argument("--load-at", choices=("checked", "profile"), default="checked",
                    help="the saturation a load is a fraction of: at the speed a check just before the cell "
                         "measures (the profile scaled as the checked model is), or the profile's as made")
    ap.add_argument("--families", help="comma-separated (parts of) family names to run; all by default")
    ap.add_argument("--recent", type=int, default=4,
                    help="the recent model: the profile corrected on the step traces of the last N real runs")
    ap.add_argument("--check", choices=("median", "by-size"), default="by-size",
                    help="the checked model: the profile scaled by each probe's ratio over the step-cost curve "
                         "by size, or by their median ratio (as `profile --recheck --rescale --rescale-by median`)")
    ap.add_argument("--check-rounds", type=int, default=3,
                    help="each speed check's probes timed this many times in a row, each probe's median over "
                         "them (every round's times are saved; until run 14 a check was one round)")
    ap.add_argument("--torch-threads", type=int,
                    help="the engines' torch threads (default: all cores); the profile then defaults to one of its own")
    ap.add_argument("--profile", help="the cost profile (made there if missing; default: the engine's, "
                                      "<model>-<dtype>-<N>threads.json with --torch-threads N)")
    ap.add_argument("--traces", help="a folder to save every real run's step trace in")
    args = ap.parse_args()
    traces_dir = Path(args.traces) if args.traces else None
    if traces_dir is not None:
        traces_dir.mkdir(parents=True, exist_ok=True)
    threads = dict(torch_threads=args.torch_threads) if args.torch_threads else {}
    engine = Engine(EngineConfig.from_options(max_num_seqs=32, max_num_batched_tokens=1024, cost_model="none",
                                              **threads))
    path = Path(args.profile) if args.profile else profile_path(engine.model_name, engine.dtype, args.torch_threads)
    if path.is_file():   # the profile as measured: a correction saved by `profile --sustained` taken off
        cost = replace(StepCostModel.load(path), decode_scales=[], prefill_scales=[], between_steps=0.0)
    else:
        cost = profile(engine)
        cost.save(path)
    print(f"cost model: {path}", flush=True)
    n = args.requests
    base_knobs = base(n)
    per_family = {name: family_saturation(family, n, cost, engine_knobs(engine)) for name, family in FAMILIES.items()}
    saturation = per_family["uniform"]
    print(f"saturation ~ {saturation:.2f} req/s (simulated)", flush=True)

    calibration_check = speed_check(engine, cost, rounds=args.check_rounds)   # the speed at the calibration
    t = time.perf_counter()
    corrected, fit_report = sustained_calibration(engine, cost, requests=n)
    wall = time.perf_counter() - t
    print(f"calibration run: {fit_report['fit_steps'] + fit_report['held_out_steps']} steps in {wall:.0f} s; "
          f"held-out step error "
          f"{100 * fit_report['before']['all']['error']:+.1f}% -> {100 * fit_report['after']['all']['error']:+.1f}% "
          f"(mean |err| {100 * fit_report['before']['all']['mean_abs_error']:.1f}% -> "
          f"{100 * fit_report['after']['all']['mean_abs_error']:.1f}%), between steps "
          f"{fit_report['between_steps_ms']:.2f} ms", flush=True)

    own = per_family if args.load_of == "family" else {name: saturation for name in FAMILIES}
    print("saturation per family (req/s):", {name: round(r, 2) for name, r in own.items()}, flush=True)
    basis = (lambda name: name) if args.load_of == "family" else (lambda name: "uniform")
    # (cell, engine, family knobs, load, the family whose saturation on `engine` the load is a fraction of)
    runs = [(f"{name}, {int(100 * load)}%", engine, knobs, load, basis(name))
            for load in (0.3, 0.8) for name, knobs in FAMILIES.items()]   # by load: the recent runs are other families
    small = Engine(EngineConfig.from_options(max_num_seqs=32, max_num_batched_tokens=1024, cost_model="none",
                                             num_kv_blocks=40, admission_policy="optimistic", min_resident_steps=2,
                                             **threads),
                   loaded=engine.loaded)
    runs.append(("forced preemption, 150%", small, {}, 1.5, "uniform"))   # of the uniform's
    if args.families:
        wanted = [w.strip() for w in args.families.split(",")]
        runs = [run for run in runs if any(w in run[0] for w in wanted)]
    by_size = args.check == "by-size"
    rows, window = [], []   # window: (cell, trace) of the last real runs
    recent = corrected
    for i, (name, eng, family, load, of) in enumerate(runs):
        if window:
            recent, _ = calibrate([t for _, t in window], cost)
        first_check, capacity = None, own[of]
        if args.load_at == "checked":
            # The machine's speed now, and the load a fraction of the saturation at that speed: a profile
            # made when the machine was faster would put "80%" beyond the targets' range (run 12).
            first_check = speed_check(eng, cost, rounds=args.check_rounds)
            capacity = family_saturation(FAMILIES[of], n, rescaled(cost, first_check, by_size), engine_knobs(engine))
        row, traces = family_row(name, eng, {**family, "rate": load * capacity}, base_knobs, capacity, cost,
                                 corrected, recent, seeds=[21 + i + 100 * j for j in range(args.seeds)],
                                 by_size=by_size, traces_dir=traces_dir, first_check=first_check,
                                 rounds=args.check_rounds)
        row["profile_saturation_req_s"] = own[of]
        row["recent_fitted_on"] = sorted({cell for cell, _ in window}) or ["the calibration run"]
        row["recent_correction"] = {"decode_scales": recent.decode_scales, "prefill_scales": recent.prefill_scales,
                                    "between_steps_s": recent.between_steps}
        rows.append(row)
        window = [*window, *((name, t) for t in traces)][-args.recent:]
        print(name, f"speed {row['speed_factor']:.3f}, load {row['measured_load']:.2f} of measured capacity",
              {k: {m: round(v, 3) for m, v in row[k].items()} for k in MODELS},
              "step error", *(round(row[f"step_error_{k}"]["error"], 3) for k in MODELS),
              "real again", {m: round(v, 3) for m, v in row.get("real_repeat", {}).items()}, flush=True)

    summary = {m: tally([{**r[m], "step_error": r[f"step_error_{m}"]["error"],
                          "step_buckets": r[f"step_error_{m}"]["buckets"]} for r in within(rows)]) for m in MODELS}
    print(summary, flush=True)

    def pct(x: float) -> str:
        return f"{100 * x:+.0f}%"

    line = "; ".join(f"{r['family']}: TTFT p50 {pct(r['profile']['ttft_p50'])} -> {pct(r['corrected']['ttft_p50'])} "
                     f"-> {pct(r['checked']['ttft_p50'])} -> {pct(r['recent']['ttft_p50'])} "
                     f"(own {pct(r['own']['ttft_p50'])}), TPOT p50 "
                     f"{pct(r['profile']['tpot_p50'])} -> {pct(r['corrected']['tpot_p50'])} -> "
                     f"{pct(r['checked']['tpot_p50'])} -> {pct(r['recent']['tpot_p50'])} "
                     f"(own {pct(r['own']['tpot_p50'])})" for r in rows)
    save(args.name, {"cost_model": str(path), "torch_threads": torch.get_num_threads(),
                     "saturation_req_s": saturation, "load_of": args.load_of, "load_at": args.load_at,
                     "saturation_per_family_req_s": own, "workload": base_knobs, "seeds": args.seeds,
                     "calibration": fit_report, "speed_check_at_calibration": calibration_check, "check": args.check,
                     "check_rounds": args.check_rounds,
                     "speed_reference": "fit",
                     "correction": {"meta": corrected.meta["calibration"],
                                    "knots": corrected.knots, "decode_scales": corrected.decode_scales,
                                    "prefill_scales": corrected.prefill_scales,
                                    "between_steps_s": corrected.between_steps},
                     "families": rows, "summary": summary},
         f"simulator error ({n} requests x {args.seeds} seed(s) per family and load), profile -> profile + trace "
         "correction (fitted on a uniform run at 70%) -> the profile scaled by a speed check before each run "
         f"({args.check}, against the profile's fit) -> "
         f"the profile corrected on the last {args.recent} real runs' traces (other families); "
         "(own: corrected on the cell's own traces, a diagnostic): "
         + line + f"; cells meeting every target of {len(within(rows))}: "
         + ", ".join(summary_text(summary, m) for m in MODELS))


if __name__ == "__main__":
    sys.exit(main())
