"""Near saturation, is what the simulator misses the machine's speed moving within a run?

`sim_calibration.py`'s "own" model (the profile corrected on a cell's own real runs) gives the
simulator each run's mean step costs; near saturation it still missed some percentiles by 25-46%
(run 7, docs/simulator.md). A shared VM's speed also moves within a run, and a slow stretch builds
a queue that the mean speed does not. This runs workload families at `--loads` of their own
simulated saturation on the real engine (`--seeds` runs of `--requests` each, metrics pooled over
them as in sim_calibration) and simulates the same requests with:

- the profile;
- "own": the profile corrected on these runs' traces (`calibrate`), at its constant speed;
- "own, timed": the same, with each run's speed timeline (`validate.speed_timeline`: per `--window`
  seconds, the measured cycles over the modelled ones) given to `simulate(speed=...)`.

Both "own" models are diagnostics, not predictions: they know the run they are compared with.
What "own, timed" still misses is the simulator's; what it gains over "own" is the within-run speed.
Also reported: each run's window factors (min / max) and the real engine against itself (the same
requests again; not for the long-prompt family, whose runs take minutes). Before the cells a short
unmeasured run warms the engine up, each cell draws seeds of its own and starts with an empty prefix
cache (the same seed draws the same prompts in every family: a first version reused them, and the
later families' real runs, hitting the earlier ones' cached prompts, came out at about half the
simulated latencies). Writes JSON and a line in docs/benchmarks.md. About 7 minutes with the
defaults.

    python benchmarks/sim_speed_timeline.py [--families uniform,...] [--loads 0.8] [--requests 60] [--seeds 2]
        [--window 2] [--name sim_speed_timeline]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from common import save
from sim_calibration import FAMILIES, base, family_saturation, pooled, real_run, relative
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
from conveyor.paths import profile_path
from conveyor.profile import profile
from conveyor.sim.cost import StepCostModel
from conveyor.sim.simulator import engine_knobs, simulate
from conveyor.sim.validate import calibrate, speed_timeline
from conveyor.sim.workload import WorkloadSpec

MODELS = ("profile", "own", "own, timed")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (parts of) family names")
    ap.add_argument("--loads", default="0.8", help="fractions of each family's own simulated saturation")
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--window", type=float, default=2.0, help="seconds per window of the speed timeline")
    ap.add_argument("--name", default="sim_speed_timeline", help="results JSON name")
    args = ap.parse_args()
    engine = Engine(EngineConfig.from_options(max_num_seqs=32, max_num_batched_tokens=1024, cost_model="none"))
    path = profile_path(engine.model_name, engine.dtype)
    if path.is_file():   # as sim_calibration prices its "profile" model: a saved correction taken off
        cost = replace(StepCostModel.load(path), decode_scales=[], prefill_scales=[], between_steps=0.0)
    else:
        cost = profile(engine)
        cost.save(path)
    knobs = engine_knobs(engine)
    wanted = [w.strip() for w in args.families.split(",")]
    cells = [(load, name, family) for load in (float(x) for x in args.loads.split(","))
             for name, family in FAMILIES.items() if any(w in name for w in wanted)]
    # A fresh engine's first steps run slow (allocator, caches): a short run first, not measured.
    real_run(engine, WorkloadSpec(**{**base(20), "rate": 5.0, "seed": 7}))
    rows = []
    for i, (load, name, family) in enumerate(cells):
        saturation = family_saturation(family, args.requests, cost, knobs)
        # Seeds of the cell's own (the same seed draws the same prompts in every family), and no prompt
        # left in the prefix cache by the cells before.
        specs = [WorkloadSpec(**{**base(args.requests), **family, "rate": load * saturation,
                                 "seed": 41 + i + 100 * j}) for j in range(args.seeds)]
        engine.core.scheduler.kv.reset_prefix_cache()
        reals, traces = [], []
        for spec in specs:
            real, trace, _ = real_run(engine, spec)
            reals.append(real)
            traces.append(trace)
        real = pooled(reals)
        own, _ = calibrate(traces, cost)
        timelines = [speed_timeline(trace, own, args.window, start=min(r.arrival for r in spec.generate()))
                     for spec, trace in zip(specs, traces)]
        speeds = {"profile": [None] * len(specs), "own": [None] * len(specs), "own, timed": timelines}
        row = {"family": f"{name}, {int(round(100 * load))}%", "rate": specs[0].rate, "seeds": [s.seed for s in specs],
               "requests": sum(len(r.records) for r in reals), "real": real,
               "window_factors": [(min(t.factors), max(t.factors)) for t in timelines]}
        for label in MODELS:
            model = cost if label == "profile" else own
            row[label] = relative([simulate(spec.generate(), cost=model, seed=spec.seed, speed=speed, **knobs)
                                   for spec, speed in zip(specs, speeds[label])], real)
        if "long" not in name:   # as sim_calibration: the long-prompt runs take minutes each
            again = []
            for spec in specs:   # the same requests on the real engine again, its prompts forgotten first
                engine.core.scheduler.kv.reset_prefix_cache()
                again.append(real_run(engine, spec)[0])
            row["real_repeat"] = {m: v for m, v in relative(again, real).items() if m != "preemptions"}
        rows.append(row)
        print(row["family"], "windows", [(round(a, 2), round(b, 2)) for a, b in row["window_factors"]],
              {k: {m: round(v, 3) for m, v in row[k].items()} for k in (*MODELS, "real_repeat") if k in row},
              flush=True)

    def pct(x: float) -> str:
        return f"{100 * x:+.0f}%"

    line = "; ".join(
        f"{r['family']} (windows {min(a for a, _ in r['window_factors']):.2f}-"
        f"{max(b for _, b in r['window_factors']):.2f}x): "
        + ", ".join(f"{m.replace('_', ' ')} " + " -> ".join(pct(r[k][m]) for k in MODELS)
                    for m in ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90"))
        + (f", real again TTFT / TPOT p50 {pct(r['real_repeat']['ttft_p50'])} / {pct(r['real_repeat']['tpot_p50'])}"
           if "real_repeat" in r else "")
        for r in rows)
    save(args.name, {"cost_model": str(path), "window_s": args.window, "workload": base(args.requests), "rows": rows},
         f"simulator error ({args.requests} requests x {args.seeds} seeds a cell), profile -> own mean step costs -> "
         f"own step costs with each run's speed per {args.window:g} s window: " + line)


if __name__ == "__main__":
    sys.exit(main())
