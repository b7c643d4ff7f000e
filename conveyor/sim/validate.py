"""Does the cost model fit this machine? Price a real engine's step trace with it.

``conveyor simulate --validate TRACE`` takes a step trace written by the engine (``conveyor serve
--step-trace run.json``, ``LLM(step_trace=...)``), prices every step's shape with the cost model
(``StepCostModel.shape_time`` plus its swap copies) and reports the error per shape bucket: decode
-only steps, prefill chunks alone and mixed steps, by token count, with the buckets split at the
model's kernel switches (the C++ GEMV's width). It also reports the time between steps (the
front end's work while the engine had requests), which a profile of the executor alone cannot
see. Check this before trusting a capacity plan: a profile measures short repeated bursts of
identical steps, a server runs long mixed ones.

With ``--calibrate OUT`` it fits a correction from the trace and writes the corrected profile:
a factor per knot of the step-cost curve (one curve for decode-only steps, one for steps with a
prefill chunk; least squares on relative error; a knot with few or no steps follows its neighbours)
and the median time between steps as a term of the model. The fit uses alternate runs of
``RUN`` consecutive steps and is reported on the others (held out), before and after. No torch.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

import numpy as np

from conveyor.engine.trace import StepTracer
from conveyor.scheduler.costs import StepCostModel, StepShape, hat_weights

RUN = 16        # held out: every other run of this many consecutive steps
# Knots the trace barely touches: each factor is pulled towards its neighbours' (SMOOTH, in steps'
# worth of evidence; a knot no step touches takes its neighbours' factor) and, very weakly, to 1.
SMOOTH = 0.1
ANCHOR = 1e-3
KINDS = ("decode", "prefill", "mixed")


@dataclass(slots=True)
class TracedStep:
    index: int           # in the trace
    shape: StepShape
    swap_blocks: int
    seconds: float       # the engine's step as measured (dt)

    @property
    def kind(self) -> str:
        if not self.shape.prefill_tokens:
            return "decode"
        return "mixed" if self.shape.decode_tokens else "prefill"


def traced_steps(trace: StepTracer) -> list[TracedStep]:
    """The trace's steps that carry their shape (failed steps left out)."""
    steps = [TracedStep(i, StepShape(**r.shape), r.swap_blocks, r.dt)
             for i, r in enumerate(trace.records) if r.shape is not None and not r.failed and r.dt > 0]
    if not steps:
        raise ValueError("the trace has no step shapes: record it again with this version (conveyor serve "
                         "--step-trace, LLM(step_trace=...))")
    return steps


def gaps_between_steps(trace: StepTracer, indices: set[int] | None = None) -> list[float]:
    """Seconds from a step's end to the next step's start, where the engine still had requests
    after the step (so the next one followed as soon as it could); `indices`: of those steps only."""
    out = []
    rs = trace.records
    for i, (a, b) in enumerate(zip(rs, rs[1:])):
        if a.running + a.waiting > 0 and b.step == a.step + 1 and (indices is None or i in indices):
            out.append(max(0.0, b.t - (a.t + a.dt)))
    return out


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


def predicted(cost: StepCostModel, step: TracedStep) -> float:
    return cost.shape_time(step.shape) + cost.swap_time(step.swap_blocks)


def step_errors(steps: list[TracedStep], cost: StepCostModel) -> dict:
    """Per bucket (kind x token range) and overall: steps, median measured and modelled ms, the
    error of the bucket's total time (modelled / measured - 1) and the mean absolute error per step."""
    def summary(group: list[TracedStep]) -> dict:
        real = [s.seconds for s in group]
        model = [predicted(cost, s) for s in group]
        return {"steps": len(group), "real_ms": 1e3 * statistics.median(real), "model_ms": 1e3 * statistics.median(model),
                "error": sum(model) / sum(real) - 1,
                "mean_abs_error": statistics.fmean(abs(m / r - 1) for m, r in zip(model, real))}

    rows = []
    for kind in KINDS:
        for lo, hi in token_buckets(cost):
            group = [s for s in steps if s.kind == kind and lo <= s.shape.tokens <= hi]
            if group:
                rows.append({"kind": kind, "tokens": _label(lo, hi), **summary(group)})
    return {"buckets": rows, "all": summary(steps)}


def validate(trace: StepTracer, cost: StepCostModel) -> dict:
    steps = traced_steps(trace)
    report = step_errors(steps, cost)
    gaps = gaps_between_steps(trace)
    report["between_steps"] = {
        "steps": len(gaps), "median_ms": 1e3 * statistics.median(gaps) if gaps else 0.0,
        "share_of_median_step": statistics.median(gaps) / report["all"]["real_ms"] * 1e3 if gaps else 0.0,
        "model_ms": 1e3 * cost.between_steps}
    return report


def _fit_curve(cost: StepCostModel, steps: list[TracedStep]) -> list[float]:
    """Factors per knot so that factor(tokens) * model ~ measured, least squares on relative error,
    with a penalty on the difference between neighbouring knots' factors (SMOOTH) and a weak pull to
    1 (ANCHOR), so that a knot no step touches takes its neighbours' factor."""
    n = len(cost.knots)
    rows, target = [], []
    for s in steps:
        p = cost.shape_time(s.shape)
        y = s.seconds - cost.swap_time(s.swap_blocks)
        if p <= 0 or y <= 0:
            continue
        tokens = min(max(s.shape.tokens, cost.knots[0]), cost.knots[-1])
        rows.append([w * p / y for w in hat_weights(cost.knots, tokens)])
        target.append(1.0)
    smooth = np.sqrt(SMOOTH) * (np.eye(n - 1, n) - np.eye(n - 1, n, 1))
    a = np.vstack([np.array(rows).reshape(-1, n), smooth, np.sqrt(ANCHOR) * np.eye(n)])
    b = np.concatenate([np.array(target), np.zeros(n - 1), np.full(n, np.sqrt(ANCHOR))])
    coef, *_ = np.linalg.lstsq(a, b, rcond=None)
    return np.maximum(coef, 0.05).tolist()


def calibrate(trace: StepTracer, cost: StepCostModel, run: int = RUN) -> tuple[StepCostModel, dict]:
    """The cost model with a correction fitted on alternate runs of `run` steps of the trace, and a
    report of the other steps' errors before and after it."""
    steps = traced_steps(trace)
    train = [s for s in steps if (s.index // run) % 2 == 0]
    held_out = [s for s in steps if (s.index // run) % 2 == 1] or train
    base = replace(cost, decode_scales=[], prefill_scales=[], between_steps=0.0)
    decode = [s for s in train if s.kind == "decode"]
    prefill = [s for s in train if s.kind != "decode"]
    gaps = gaps_between_steps(trace, {s.index for s in train})
    corrected = replace(base, decode_scales=_fit_curve(base, decode) if decode else [],
                        prefill_scales=_fit_curve(base, prefill) if prefill else [],
                        between_steps=statistics.median(gaps) if gaps else 0.0)
    report = {"fit_steps": len(train), "held_out_steps": len(held_out), "run": run,
              "between_steps_ms": 1e3 * corrected.between_steps,
              "before": step_errors(held_out, base), "after": step_errors(held_out, corrected)}
    corrected.meta = {**cost.meta, "calibration": {
        "trace": trace.meta, "fit_steps": len(train), "held_out_steps": len(held_out),
        "held_out_error_before": report["before"]["all"]["error"],
        "held_out_error_after": report["after"]["all"]["error"],
        "held_out_mean_abs_error_before": report["before"]["all"]["mean_abs_error"],
        "held_out_mean_abs_error_after": report["after"]["all"]["mean_abs_error"]}}
    return corrected, report


def format_errors(report: dict, title: str) -> str:
    lines = [title, f"{'steps':>14} {'tokens':>8} {'count':>6} {'real ms':>8} {'model ms':>9} {'error':>7} {'mean |err|':>10}"]
    for r in [*report["buckets"], {"kind": "all", "tokens": "", **report["all"]}]:
        lines.append(f"{r['kind']:>14} {r['tokens']:>8} {r['steps']:>6} {r['real_ms']:>8.2f} {r['model_ms']:>9.2f} "
                     f"{100 * r['error']:>+6.1f}% {100 * r['mean_abs_error']:>9.1f}%")
    gap = report.get("between_steps")
    if gap:
        lines.append(f"between steps (engine busy, outside its step): median {gap['median_ms']:.2f} ms over "
                     f"{gap['steps']} gaps = {100 * gap['share_of_median_step']:.0f}% of the median step; "
                     f"the model adds {gap['model_ms']:.2f} ms")
    return "\n".join(lines)


__all__ = ["RUN", "TracedStep", "calibrate", "format_errors", "gaps_between_steps", "step_errors", "token_buckets",
           "traced_steps", "validate"]
