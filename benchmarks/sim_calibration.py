"""Does a correction fitted from one real run's step trace make the simulator right on other workloads?

The cost model is this machine's profile (`conveyor profile`, run first if missing). The
calibration is what `conveyor profile --sustained` adds (`conveyor.sim.validate.
sustained_calibration`): a short sustained run (uniform prompts 32-256 and outputs 16-128, Poisson
at 70% of the simulated saturation rate) through the real engine with a step trace, the correction
fitted on half of its steps and reported on the other half. Then workload families that were not
in the fit run on the real engine and in the simulator, with the profile as it is and with the
corrected one, each at light load (30% of the simulated saturation) and near it (80%):

- uniform (the calibration's distributions, other seeds);
- heavy-tailed outputs (lognormal, median 32, up to 400);
- bursty arrivals (gamma, CV 3);
- shared prefixes (4 groups, 128-token prefixes, prefix caching on);
- long prompts (600-1500 tokens, chunked under the 1024-token budget);
- and forced preemption (a 40-block KV cache, optimistic admission, overloaded at 150%).

A third model, "checked", is the corrected one scaled by a speed check just before each run
(``conveyor profile --recheck``: the profile's probe steps timed again, against their time at the
calibration): how much of the error is this shared machine's drift from one run to the next.

Near saturation (80%) the short-prompt families run a second time on the real engine: the difference
between two real runs of one workload is the floor under the simulator's error at this sample size.

Reported per family and load: TTFT and TPOT p50 / p90 and throughput, real vs simulated (relative
error), preemptions, and the step-cost error of the run's own trace under the three models. Writes JSON
and a line in docs/benchmarks.md.

    python benchmarks/sim_calibration.py [--requests 60]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

from common import save
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
from conveyor.paths import profile_path
from conveyor.profile import profile, speed_check
from conveyor.sim.cost import StepCostModel
from conveyor.sim.harness import run_on_engine
from conveyor.sim.simulator import SimResult, engine_knobs, saturation_rate, simulate
from conveyor.sim.validate import sustained_calibration, validate
from conveyor.sim.workload import WorkloadSpec

METRICS = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "throughput")


def real_run(engine: Engine, spec: WorkloadSpec) -> tuple[SimResult, object, float]:
    workload = spec.generate()
    t = time.perf_counter()
    records, trace = run_on_engine(engine, workload, seed=spec.seed)
    return SimResult(records, engine.stats(), [trace], block_size=engine.config.block_size), trace, \
        time.perf_counter() - t


def errors(engine: Engine, spec: WorkloadSpec, real: SimResult, cost: StepCostModel) -> dict:
    sim = simulate(spec.generate(), cost=cost, seed=spec.seed, **engine_knobs(engine))
    return {**{m: sim.metric(m) / real.metric(m) - 1 for m in METRICS}, "preemptions": sim.stats.num_preemptions}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=60)
    args = ap.parse_args()
    engine = Engine(EngineConfig.from_options(max_num_seqs=32, max_num_batched_tokens=1024, cost_model="none"))
    path = profile_path(engine.model_name, engine.dtype)
    if path.is_file():   # the profile as measured: a correction saved by `profile --sustained` taken off
        cost = replace(StepCostModel.load(path), decode_scales=[], prefill_scales=[], between_steps=0.0)
    else:
        cost = profile(engine)
        cost.save(path)
    print(f"cost model: {path}", flush=True)
    n = args.requests
    base = dict(num_requests=n, prompt_len="32:256", output_len="16:128")
    saturation = saturation_rate(WorkloadSpec(**base, seed=100).generate(), cost, **engine_knobs(engine))
    print(f"saturation ~ {saturation:.2f} req/s (simulated)", flush=True)

    speed_cal = speed_check(engine, cost)["factor"] or 1.0   # the machine's speed when the calibration ran
    t = time.perf_counter()
    corrected, fit_report = sustained_calibration(engine, cost, requests=n)
    wall = time.perf_counter() - t
    print(f"calibration run: {fit_report['fit_steps'] + fit_report['held_out_steps']} steps in {wall:.0f} s; "
          f"held-out step error "
          f"{100 * fit_report['before']['all']['error']:+.1f}% -> {100 * fit_report['after']['all']['error']:+.1f}% "
          f"(mean |err| {100 * fit_report['before']['all']['mean_abs_error']:.1f}% -> "
          f"{100 * fit_report['after']['all']['mean_abs_error']:.1f}%), between steps "
          f"{fit_report['between_steps_ms']:.2f} ms", flush=True)

    shapes = {"uniform": {}, "heavy-tailed outputs": dict(output_len="lognormal:32:1.0:400"),
              "bursty (gamma CV 3)": dict(arrival="gamma:3"), "shared prefixes": dict(prefix_groups=4, prefix_len=128),
              "long prompts": dict(prompt_len="600:1500")}
    runs = [(f"{name}, {int(100 * load)}%", engine, {**knobs, "rate": load * saturation})
            for name, knobs in shapes.items() for load in (0.3, 0.8)]
    small = Engine(EngineConfig.from_options(max_num_seqs=32, max_num_batched_tokens=1024, cost_model="none",
                                             num_kv_blocks=40, admission_policy="optimistic", min_resident_steps=2),
                   loaded=engine.loaded)
    runs.append(("forced preemption, 150%", small, {"rate": 1.5 * saturation}))
    rows = []
    for seed, (name, eng, knobs) in enumerate(runs, start=21):
        spec = WorkloadSpec(**{**base, **knobs, "seed": seed})
        preempted = eng.stats().num_preemptions
        speed = speed_check(eng, cost)["factor"] or 1.0   # just before the run, against the profile's
        checked = corrected.scaled(speed / speed_cal)
        real, trace, wall = real_run(eng, spec)
        row = {"family": name, "rate": spec.rate, "wall_s": wall, "speed_factor": speed,
               "real": {**{m: real.metric(m) for m in METRICS}, "preemptions": eng.stats().num_preemptions - preempted},
               "profile": errors(eng, spec, real, cost), "corrected": errors(eng, spec, real, corrected),
               "checked": errors(eng, spec, real, checked),
               "step_error_profile": validate(trace, cost)["all"], "step_error_corrected": validate(trace, corrected)["all"],
               "step_error_checked": validate(trace, checked)["all"]}
        if 0.5 < knobs["rate"] / saturation < 1 and "long" not in name:
            # The same workload on the real engine again: how far one run's percentiles are from the
            # next one's (the floor under any simulator's error at this sample size). The first run's
            # prompts are in the prefix cache: forgotten, or every prompt of the second run would hit.
            eng.core.scheduler.kv.reset_prefix_cache()
            again, _, _ = real_run(eng, spec)
            row["real_repeat"] = {m: again.metric(m) / real.metric(m) - 1 for m in METRICS}
        rows.append(row)
        print(name, f"speed {speed:.3f}", {k: {m: round(v, 3) for m, v in row[k].items()}
                                            for k in ("profile", "corrected", "checked")},
              "step error", *(round(row[f"step_error_{k}"]["error"], 3) for k in ("profile", "corrected", "checked")),
              "real again", {m: round(v, 3) for m, v in row.get("real_repeat", {}).items()}, flush=True)

    def pct(x: float) -> str:
        return f"{100 * x:+.0f}%"

    line = "; ".join(f"{r['family']}: TTFT p50 {pct(r['profile']['ttft_p50'])} -> {pct(r['corrected']['ttft_p50'])} "
                     f"-> {pct(r['checked']['ttft_p50'])}, TPOT p50 {pct(r['profile']['tpot_p50'])} -> "
                     f"{pct(r['corrected']['tpot_p50'])} -> {pct(r['checked']['tpot_p50'])}" for r in rows)
    save("sim_calibration", {"cost_model": str(path), "saturation_req_s": saturation, "workload": base,
                             "calibration": fit_report, "speed_factor_at_calibration": speed_cal,
                             "correction": {"meta": corrected.meta["calibration"],
                                            "knots": corrected.knots, "decode_scales": corrected.decode_scales,
                                            "prefill_scales": corrected.prefill_scales,
                                            "between_steps_s": corrected.between_steps},
                             "families": rows},
         "simulator error, profile -> profile + trace correction (fitted on a uniform run at 70%) -> the "
         "correction scaled by a speed check before each run: " + line)


if __name__ == "__main__":
    sys.exit(main())
