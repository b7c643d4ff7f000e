"""Does the cost model fit this machine? Price a real engine's step trace with it.

``conveyor simulate --validate TRACE`` takes a step trace written by the engine (``conveyor serve
--step-trace run.json``, ``LLM(step_trace=...)``) and prices every step with the cost model. What
is compared is a step's **cycle**: from its start to the next step's start, i.e. the engine's step
(`dt`) and the work after it before the next one (the front end: detokenizing, queues, streaming),
measured on steps that another step followed while the engine still had requests; the model's
cycle is ``shape_time`` (the profile folds the engine's own work outside the executor into it),
its swap copies and ``between_steps``. Errors are reported per shape bucket: decode-only steps,
prefill chunks alone and mixed steps, by token count, split at the C++ GEMV's width (from the
profile's ``dispatch_thresholds``; 8 without one). Check this before trusting a capacity plan: a
profile measures short repeated bursts of identical steps, a server runs long mixed ones.

With ``--calibrate OUT`` it fits a correction from the trace and writes the corrected profile: the
median time between steps as measured (``between_steps``), and a factor per knot of the step-cost
curve (one curve for decode-only steps, one for steps with a prefill chunk) so that the factor
times the step plus that time gives the cycle, by least squares on the error relative to the
model's price (the factor is then a mean of measured / modelled, and the corrected model keeps the
trace's total time); a knot no step touches takes its neighbours' factor. (Fitting the constant
jointly with the factors was tried: the two trade against each other where steps come in one size,
and the fit put 1.65 ms "between steps" where 0.13 ms were measured.) The fit uses alternate runs
of ``RUN`` consecutive steps and is reported on the others ("held out"; neighbouring runs are
alike, so this is a check of the fit, not of other traffic: validate a second trace for that).
No torch.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from conveyor.core.trace import StepTracer
from conveyor.scheduler.costs import AfterPrefill, StepCostModel, StepShape, flat_hat_weights
from conveyor.sim.harness import run_on_engine
from conveyor.sim.simulator import engine_knobs, saturation_rate
from conveyor.sim.workload import WorkloadSpec

RUN = 16        # held out: every other run of this many consecutive steps
# Knots the trace barely touches: each factor is pulled towards its neighbours' (SMOOTH, in steps'
# worth of evidence; a knot no step touches takes its neighbours' factor), and a knot some steps
# touch with less evidence than EVIDENCE steps' worth (the sum of its squared interpolation weights)
# is pulled to 1 by the rest (a few steps far from a knot once put a factor of 2.5 on it).
SMOOTH = 0.1
ANCHOR = 1e-3
EVIDENCE = 1.0
KINDS = ("decode", "prefill", "mixed")


@dataclass(slots=True)
class TracedStep:
    index: int           # in the trace
    shape: StepShape
    swap_blocks: int
    seconds: float       # its cycle: the engine's step (dt) and the time until the next step started
    gap: float           # of which the time until the next step started
    last_prefill: int = 0     # prefill tokens of the last step before it that carried some
    since_prefill: int = -1   # decode-only steps between that one and this (-1: none before, or it has prefill)

    @property
    def kind(self) -> str:
        if not self.shape.prefill_tokens:
            return "decode"
        return "mixed" if self.shape.decode_tokens else "prefill"


def _followed(trace: StepTracer) -> dict[int, float]:
    """Index -> seconds from the step's end to the next step's start, for steps the next one
    followed as soon as it could: the engine still had requests after it, no idle plan between."""
    out = {}
    rs = trace.records
    for i, (a, b) in enumerate(zip(rs, rs[1:])):
        if a.running + a.waiting + a.swapped > 0 and b.step == a.step + 1:
            out[i] = max(0.0, b.t - (a.t + a.dt))
    return out


def traced_steps(trace: StepTracer) -> list[TracedStep]:
    """The trace's steps with a shape and a forward pass (not failed, not only swaps) that another
    step followed at once, as cycles."""
    gaps = _followed(trace)
    steps = []
    state = AfterPrefill()   # every step run counts, as in the simulator's executor
    for i, r in enumerate(trace.records):
        prefill = r.shape["prefill_tokens"] if r.shape is not None else r.prefill_tokens
        position = state.advance(prefill, r.prefill_tokens + r.decode_tokens)
        if r.shape is None or r.failed or i not in gaps:
            continue
        shape = StepShape(**{k: v for k, v in r.shape.items() if k in StepShape.__slots__})
        if shape.tokens:
            steps.append(TracedStep(i, shape, r.swap_blocks, r.dt + gaps[i], gaps[i], *position))
    if not steps:
        raise ValueError("the trace has no busy steps with their shapes: record one with this version "
                         "(conveyor serve --step-trace, LLM(step_trace=...)) while requests keep the engine busy")
    return steps


def gaps_between_steps(trace: StepTracer) -> list[float]:
    """Seconds from a step's end to the next step's start, where the next one followed at once."""
    return list(_followed(trace).values())


def token_buckets(cost: StepCostModel) -> list[tuple[int, int]]:
    """Token-count ranges split at the model's kernel switches (the GEMV's width, from the profile)."""
    gemv = int(cost.meta.get("dispatch_thresholds", {}).get("gemv_tokens") or 8)
    edges = sorted({1, gemv, 16, 64, 256})
    ranges, lo = [], 1
    for e in edges:
        if e >= lo:
            ranges.append((lo, e))
            lo = e + 1
    return ranges + [(lo, 1 << 62)]


def _label(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}+" if hi >= 1 << 62 else f"{lo}-{hi}"


def after_prefill(cost: StepCostModel, step: TracedStep) -> float:
    """The model's extra time for a decode step that follows a prefill chunk (cost.py, AfterPrefill)."""
    return cost.after_prefill_time(step.last_prefill, step.since_prefill)


def predicted(cost: StepCostModel, step: TracedStep) -> float:
    """The model's cycle for the step: the step, its swap copies, the extra time of a decode step
    after a prefill chunk and the time between steps."""
    return cost.shape_time(step.shape) + cost.swap_time(step.swap_blocks) + after_prefill(cost, step) \
        + cost.between_steps


def step_errors(steps: list[TracedStep], cost: StepCostModel) -> dict:
    """Per bucket (kind x token range) and overall: steps, median measured and modelled cycle (ms),
    the error of the bucket's total time (modelled / measured - 1) and the mean absolute error per step."""
    return runs_step_errors([(steps, cost)])


def runs_step_errors(runs: Sequence[tuple[Sequence[TracedStep], StepCostModel]]) -> dict:
    """`step_errors` of several runs' steps pooled, each run's priced by its own model (a model
    scaled by the speed check before each run); buckets split where the first run's model says."""
    priced = [(s, predicted(cost, s)) for steps, cost in runs for s in steps]

    def summary(group: list[tuple[TracedStep, float]]) -> dict:
        real = [s.seconds for s, _ in group]
        model = [m for _, m in group]
        return {"steps": len(group), "real_ms": 1e3 * statistics.median(real),
                "model_ms": 1e3 * statistics.median(model), "error": sum(model) / sum(real) - 1,
                "mean_abs_error": statistics.fmean(abs(m / r - 1) for m, r in zip(model, real))}

    rows = []
    for kind in KINDS:
        for lo, hi in token_buckets(runs[0][1]):
            group = [(s, m) for s, m in priced if s.kind == kind and lo <= s.shape.tokens <= hi]
            if group:
                rows.append({"kind": kind, "tokens": _label(lo, hi), **summary(group)})
    return {"buckets": rows, "all": summary(priced)}


def buckets_within(buckets: list[dict], tolerance: float = 0.10, min_steps: int = 20) -> bool:
    """Issue 20's step-cost target on a `step_errors` report's buckets: every bucket of at least
    `min_steps` steps (fewer are a handful of steps, often the first of a run) within `tolerance`."""
    return all(abs(b["error"]) <= tolerance for b in buckets if b["steps"] >= min_steps)


LATENCY_METRICS = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "throughput")


def targets_met(rel: dict) -> tuple[bool, bool]:
    """Issue 20's targets on one cell's relative errors (simulated / real - 1, by metric): (TTFT and
    TPOT p50 within 15%, every target: the p90s within 25% and throughput within 5% too)."""
    p50 = abs(rel["ttft_p50"]) <= 0.15 and abs(rel["tpot_p50"]) <= 0.15
    return p50, p50 and abs(rel["ttft_p90"]) <= 0.25 and abs(rel["tpot_p90"]) <= 0.25 and abs(rel["throughput"]) <= 0.05


def repeat_floor(repeats: Sequence[dict], cells: int = 4) -> dict:
    """The floor under a simulator's error: the real engine run twice on the same requests, each
    repeat the second run's metrics relative to the first's. Per metric the median and RMS difference;
    the repeats missing the p50 targets or any target as measured, and as an exact simulator would
    (one that predicts the runs' mean is off from one run by the difference / sqrt 2); `run_passes`:
    the chance that `cells` such cells all meet every target, taking them as independent."""
    out: dict = {"repeats": len(repeats)}
    for m in LATENCY_METRICS:
        d = [r[m] for r in repeats]
        out[m] = {"median_abs": statistics.median(map(abs, d)), "rms": math.sqrt(statistics.fmean(x * x for x in d))}
    for label, scale in (("measured", 1.0), ("exact_simulator", 1 / math.sqrt(2))):
        verdicts = [targets_met({m: r[m] * scale for m in LATENCY_METRICS}) for r in repeats]
        missed = sum(not every for _, every in verdicts)
        out[label] = {"missed_p50": sum(not p50 for p50, _ in verdicts), "missed_any": missed,
                      "run_passes": (1 - missed / len(repeats)) ** cells}
    return out


def _traces(trace: StepTracer | Sequence[StepTracer]) -> list[StepTracer]:
    return [trace] if isinstance(trace, StepTracer) else list(trace)


WINDOW = 2.0   # seconds: the speed timeline's window


@dataclass
class SpeedTimeline:
    """A real run's machine speed over time, as `simulate(speed=...)` takes it: per window of
    `window` seconds, the measured cycles of the busy steps that started in it over the cost model's
    cycles for them (a ratio of sums: the window's total time). Called with a time on the
    simulator's clock, where the trace's first step starts at `start` (the workload's first
    arrival); before the first window and past the last, the nearest one's; a window without busy
    steps, the one before it's."""
    window: float
    start: float
    factors: list[float]

    def __call__(self, t: float) -> float:
        i = int((t - self.start) // self.window)
        return self.factors[min(max(i, 0), len(self.factors) - 1)]

    def relative(self) -> list[float]:
        """The factors over their mean (each window counts once): the speed's moves within the run."""
        mean = statistics.fmean(self.factors)
        return [f / mean for f in self.factors]


def speed_timeline(trace: StepTracer, cost: StepCostModel, window: float = WINDOW, start: float = 0.0,
                   steps: list[TracedStep] | None = None) -> SpeedTimeline:
    """The trace's machine speed against `cost`, window by window (SpeedTimeline), its first step at
    `start` on the simulator's clock. `steps`: the trace's `traced_steps`, where the caller has them."""
    steps = traced_steps(trace) if steps is None else steps
    t0 = trace.records[0].t
    sums: dict[int, list[float]] = {}
    for s in steps:
        acc = sums.setdefault(int((trace.records[s.index].t - t0) // window), [0.0, 0.0])
        acc[0] += s.seconds
        acc[1] += predicted(cost, s)
    factors, last = [], 1.0
    for i in range(max(sums) + 1):
        if i in sums and sums[i][1] > 0:
            last = sums[i][0] / sums[i][1]
        factors.append(last)
    return SpeedTimeline(window, start, factors)


def validate(trace: StepTracer | Sequence[StepTracer], cost: StepCostModel) -> dict:
    """Every busy step of the trace (or of several traces, pooled) priced by `cost`, per bucket; and
    how the machine's speed moved within each trace (``speed_windows``: per WINDOW seconds, relative
    to the trace's mean, pooled)."""
    traces = _traces(trace)
    per_trace = [traced_steps(t) for t in traces]
    report = step_errors([s for steps in per_trace for s in steps], cost)
    moves = [f for t, steps in zip(traces, per_trace) for f in speed_timeline(t, cost, steps=steps).relative()]
    report["speed_windows"] = {"window_s": WINDOW, "windows": len(moves), "min": min(moves), "max": max(moves),
                               "sd": statistics.pstdev(moves)}
    gaps = [g for t in traces for g in gaps_between_steps(t)]
    cycle = report["all"]["real_ms"] * 1e-3
    report["between_steps"] = {
        "steps": len(gaps), "median_ms": 1e3 * statistics.median(gaps) if gaps else 0.0,
        "share_of_median_cycle": statistics.median(gaps) / cycle if gaps and cycle else 0.0,
        "model_ms": 1e3 * cost.between_steps}
    return report


def _fit_curve(cost: StepCostModel, steps: list[TracedStep], between: float) -> list[float]:
    """Factors per knot so that factor(tokens) * model + `between` ~ measured cycle: least squares on
    the error relative to the model's price (each step's measured / modelled ratio against the
    factor), with a penalty on the difference between neighbouring knots' factors (SMOOTH), a pull
    to 1 for knots few steps touch (EVIDENCE; ANCHOR for all), and a factor of 1 past the trace's
    largest (or below its smallest) step: where the trace has little or nothing to say, the profile
    stands. Relative to the price, not to the measurement: the fitted factor is then the mean ratio,
    so the corrected model keeps the trace's total time (what a queue feels); relative to noisy
    measurements it came out ~2 sigma^2 low (3-6% on the Zen4's traces, per-step noise ~10%)."""
    n = len(cost.knots)
    rows, ratios, evidence = [], [], np.zeros(n)
    for s in steps:
        p = cost.shape_time(s.shape)
        y = s.seconds - cost.swap_time(s.swap_blocks) - after_prefill(cost, s) - between
        if p <= 0 or y <= 0:
            continue
        h = np.array(flat_hat_weights(cost.knots, s.shape.tokens))
        rows.append(h)
        ratios.append(y / p)
        evidence += h ** 2
    data = np.array(rows).reshape(-1, n)
    anchor = np.sqrt(ANCHOR + np.where(evidence > 0, np.maximum(0.0, EVIDENCE - evidence), 0.0))
    smooth = np.sqrt(SMOOTH) * (np.eye(n - 1, n) - np.eye(n - 1, n, 1))
    a = np.vstack([data, smooth, np.diag(anchor)])
    b = np.concatenate([np.array(ratios), np.zeros(n - 1), anchor])
    coef, *_ = np.linalg.lstsq(a, b, rcond=None)
    touched = np.flatnonzero(np.abs(data).sum(0) > 0)
    if len(touched):
        coef[:touched[0]] = 1.0
        coef[touched[-1] + 1:] = 1.0
    return np.maximum(coef, 0.05).tolist()


def calibrate(trace: StepTracer | Sequence[StepTracer], cost: StepCostModel,
              run: int = RUN) -> tuple[StepCostModel, dict]:
    """The cost model with a correction fitted on alternate runs of `run` steps of the trace (any
    correction it had replaced), and a report of the other steps' errors with the model as given
    ("before") and corrected ("after"). Several traces (e.g. the last few runs of a server whose
    machine drifts) are pooled, each split into its own alternate runs."""
    traces = _traces(trace)
    steps = [s for t in traces for s in traced_steps(t)]   # indices within each trace
    train = [s for s in steps if (s.index // run) % 2 == 0]
    held_out = [s for s in steps if (s.index // run) % 2 == 1]
    if not train or not held_out:
        raise ValueError(f"the trace is too short to calibrate on: {len(steps)} busy steps (at least two runs "
                         f"of {run} are needed, one to fit and one to check)")
    base = replace(cost, decode_scales=[], prefill_scales=[], between_steps=0.0)
    between = statistics.median(s.gap for s in train)
    decode = [s for s in train if s.kind == "decode"]
    prefill = [s for s in train if s.kind != "decode"]
    corrected = replace(base, decode_scales=_fit_curve(base, decode, between) if decode else [],
                        prefill_scales=_fit_curve(base, prefill, between) if prefill else [], between_steps=between)
    report = {"fit_steps": len(train), "held_out_steps": len(held_out), "run": run,
              "between_steps_ms": 1e3 * corrected.between_steps,
              "before": step_errors(held_out, cost), "after": step_errors(held_out, corrected)}
    corrected.meta = {**cost.meta, "calibration": {
        "trace": traces[0].meta if len(traces) == 1 else [t.meta for t in traces],
        "fit_steps": len(train), "held_out_steps": len(held_out),
        "held_out_error_before": report["before"]["all"]["error"],
        "held_out_error_after": report["after"]["all"]["error"],
        "held_out_mean_abs_error_before": report["before"]["all"]["mean_abs_error"],
        "held_out_mean_abs_error_after": report["after"]["all"]["mean_abs_error"]}}
    return corrected, report


def sustained_calibration(engine, cost: StepCostModel, requests: int = 60, load: float = 0.7,
                          seed: int = 11) -> tuple[StepCostModel, dict]:
    """A short sustained run of mixed traffic on the real engine (`engine`: conveyor.engine.Engine;
    prompts 32-256 and outputs 16-128 tokens, Poisson at `load` times the rate `cost` predicts the
    engine saturates at) and the correction calibrated on its step trace (``conveyor profile
    --sustained``)."""
    base = dict(num_requests=requests, prompt_len="32:256", output_len="16:128")
    rate = load * saturation_rate(WorkloadSpec(**base, seed=seed + 1).generate(), cost, **engine_knobs(engine))
    _, trace = run_on_engine(engine, WorkloadSpec(**base, rate=rate, seed=seed).generate(), seed=seed)
    corrected, report = calibrate(trace, cost)
    corrected.meta["calibration"].update(sustained={"requests": requests, "rate": rate, "load": load})
    return corrected, report


def format_errors(report: dict, title: str) -> str:
    lines = [title, f"{'steps':>14} {'tokens':>8} {'count':>6} {'real ms':>8} {'model ms':>9} {'error':>7} {'mean |err|':>10}",
             "(the median cycle per step: the step and the time until the next one started)"]
    for r in [*report["buckets"], {"kind": "all", "tokens": "", **report["all"]}]:
        lines.append(f"{r['kind']:>14} {r['tokens']:>8} {r['steps']:>6} {r['real_ms']:>8.2f} {r['model_ms']:>9.2f} "
                     f"{100 * r['error']:>+6.1f}% {100 * r['mean_abs_error']:>9.1f}%")
    gap = report.get("between_steps")
    if gap:
        lines.append(f"between steps (engine busy, outside its step): median {gap['median_ms']:.2f} ms over "
                     f"{gap['steps']} gaps = {100 * gap['share_of_median_cycle']:.0f}% of the median cycle; "
                     f"the model adds {gap['model_ms']:.2f} ms to its steps")
    speed = report.get("speed_windows")
    if speed and speed["windows"] > 1:
        lines.append(f"machine speed within the run ({speed['windows']} windows of {speed['window_s']:g} s, "
                     f"measured / modelled over the run's mean): {speed['min']:.2f}-{speed['max']:.2f}x, "
                     f"sd {100 * speed['sd']:.1f}% (near saturation the queue multiplies such moves)")
    return "\n".join(lines)


__all__ = ["RUN", "SpeedTimeline", "TracedStep", "buckets_within", "calibrate", "format_errors", "gaps_between_steps",
           "runs_step_errors", "speed_timeline", "step_errors", "sustained_calibration", "token_buckets",
           "traced_steps", "validate"]
