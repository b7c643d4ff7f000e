"""Does a speed check before a run say how far the profile will be off during it?

`conveyor profile --recheck` times the profile's probe steps again and reports their median ratio
to the profile's times (the factor; ``--rescale`` multiplies the profile by it). Every real run of
`sim_calibration.py` has such a check just before it and the profile's step-cost error on the run's
own trace after it (``speed_factors`` and ``step_error_profile.per_run`` in its JSON). This pools
those pairs from every result given (all ``results/sim_calibration*.json`` by default), per machine
and torch thread count (the results' ``cpu_family`` and ``threads``), and asks how much of the factor
the run's step cost followed:

- the exponent c of ``measured / modelled ~ factor ** c`` (least squares on logarithms, through 1:
  c = 1 means the run moved exactly as the check said, 0 that the check said nothing);
- the mean absolute step-cost error of the runs' profiles as they are, multiplied by the factor
  (``--rescale``), and multiplied by ``factor ** c`` with c fitted on the other results of the same
  machine (left out one result at a time, so each number is a prediction).

Analysis of saved results only (no model runs). Writes JSON and a line in docs/benchmarks.md.

    python benchmarks/speed_checks.py [results/sim_calibration_x.json ...] [--name speed_checks]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from common import RESULTS, save


def pairs(result: dict) -> list[tuple[float, float]]:
    """(speed check factor, the profile's step-cost error on the run's trace) per real run."""
    out = []
    for row in result["families"]:
        errors = row.get("step_error_profile", {})
        per_run = [r["error"] for r in errors.get("per_run", [])] or [errors.get("error")]
        factors = row.get("speed_factors") or [row.get("speed_factor")]
        out += [(s, e) for s, e in zip(factors, per_run) if s and e is not None and e > -1]
    return out


def exponent(data: list[tuple[float, float]]) -> float:
    """c in (1 + error) ~ factor ** -c: how much of the check's factor the run's step cost followed
    (the profile priced the run's steps at 1 + error of their measured time; the check found the
    probes at `factor` of theirs)."""
    x = [math.log(s) for s, _ in data]
    y = [-math.log(1 + e) for _, e in data]
    return sum(a * b for a, b in zip(x, y)) / sum(a * a for a in x)


def rescaled_error(factor: float, error: float, c: float) -> float:
    """A run's absolute step-cost error with the profile multiplied by factor ** c."""
    return abs((1 + error) * factor ** c - 1)


def mean_abs(data: list[tuple[float, float]], c: float) -> float:
    """Mean absolute step-cost error with the profile multiplied by factor ** c."""
    return statistics.fmean(rescaled_error(s, e, c) for s, e in data)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="*", help="sim_calibration result JSONs (default: all in benchmarks/results)")
    ap.add_argument("--name", default="speed_checks", help="results JSON name")
    args = ap.parse_args()
    paths = [Path(p) for p in args.results] or sorted(RESULTS.glob("sim_calibration*.json"))
    by_machine: dict[str, dict[str, list]] = {}
    for path in paths:
        result = json.loads(path.read_text())
        data = pairs(result)
        if data:
            # Per machine and thread count: one thread's steps move differently (machine_steadiness.py).
            key = f"{result['machine']['cpu_family']}, {result['machine'].get('threads', '?')} threads"
            by_machine.setdefault(key, {})[path.stem] = data
    machines = {}
    for cpu, results in by_machine.items():
        every = [p for data in results.values() for p in data]
        row = {"results": {}, "runs": len(every), "exponent": exponent(every),
               "mean_abs_error": {"as profiled": mean_abs(every, 0.0), "rescaled": mean_abs(every, 1.0)}}
        if len(results) > 1:   # each result's runs priced with the exponent of the others
            held = []
            for name, data in results.items():
                c = exponent([p for other, d in results.items() if other != name for p in d])
                held += [(s, e, c) for s, e in data]
                row["results"][name] = {"runs": len(data), "exponent_of_others": c,
                                        "as profiled": mean_abs(data, 0.0), "rescaled": mean_abs(data, 1.0),
                                        "partly rescaled": mean_abs(data, c)}
            row["mean_abs_error"]["partly rescaled"] = statistics.fmean(rescaled_error(*run) for run in held)
        machines[cpu] = row
        print(cpu, {k: v for k, v in row.items() if k != "results"}, flush=True)

    def summary(cpu: str, row: dict) -> str:
        errs = row["mean_abs_error"]
        text = (f"{cpu}: {row['runs']} runs, step cost followed the check's factor to the power "
                f"{row['exponent']:.2f}; mean |step error| {100 * errs['as profiled']:.1f}% as profiled, "
                f"{100 * errs['rescaled']:.1f}% rescaled by the factor")
        if "partly rescaled" in errs:
            text += f", {100 * errs['partly rescaled']:.1f}% by factor^c (c of the other results)"
        return text

    save(args.name, {"results": [str(p) for p in paths], "machines": machines},
         "speed check before a run vs the profile's step-cost error during it: "
         + "; ".join(summary(cpu, row) for cpu, row in machines.items()))


if __name__ == "__main__":
    sys.exit(main())
