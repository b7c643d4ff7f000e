"""Does a speed check before a run say how far the profile will be off during it?

`conveyor profile --recheck` times the profile's probe steps again and reports their median ratio
to what the profile's fit prices them at (the factor; ``--rescale --rescale-by median`` multiplies the profile by it).
Every real run of `sim_calibration.py` has such a check just before it and the profile's step-cost
error on the run's own trace after it (``speed_factors`` and ``step_error_profile.per_run`` in its
JSON). This pools those pairs from every result given (all ``results/sim_calibration*.json`` by
default), per machine and torch thread count (the results' ``cpu_family`` and ``threads``), and asks
how much of the factor the run's step cost followed:

- the exponent c of ``measured / modelled ~ factor ** c`` (least squares on logarithms, through 1:
  c = 1 means the run moved exactly as the check said, 0 that the check said nothing);
- the mean absolute step-cost error of the runs' profiles as they are, multiplied by the factor
  (``--rescale --rescale-by median``), and multiplied by ``factor ** c`` with c fitted on the other results of the same
  machine (left out one result at a time, so each number is a prediction).

Each for two references, on the same runs. Until 2026-12-06 a check compared with the probe steps' own
times at the profile's end (``"probe"``); results since (``speed_reference: fit``) compare with the
profile's fit at the probes' shapes (``"fit"``, `conveyor.profile.probe_reference`). Where a result's
profile is in ``--profiles`` (default ``results/profiles``: the one whose probe times, or fit's prices,
are the reference of the result's check at calibration) each run's check is taken against the other
reference too, from each probe's ratio (``speed_by_tokens``) and the profile's probe times over its
fit's prices. ``"probe, every run"``: every older result's checks as made, its profile there or not;
a result since whose profile is not there is left out.

Analysis of saved results only (no model runs). Writes JSON and a line in docs/benchmarks.md.

    python benchmarks/speed_checks.py [results/sim_calibration_x.json ...] [--profiles DIR] [--name speed_checks]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from common import RESULTS, save
from conveyor.profile import probe_by_tokens, probe_reference
from conveyor.sim.cost import StepCostModel


EVERY = "probe, every run"   # the older results' checks as made, with or without their profile


def load_profiles(folder: Path) -> list[tuple[Path, StepCostModel]]:
    """The saved profiles in `folder` that have probe times."""
    models = [(path, StepCostModel.load(path)) for path in sorted(folder.glob("*.json"))]
    return [(path, model) for path, model in models if model.meta.get("probe")]


def profile_of(result: dict, profiles: list[tuple[Path, StepCostModel]]) -> tuple[Path, StepCostModel] | None:
    """The profile a sim_calibration result ran against: the one whose probe times (older results) or
    fit's prices (``speed_reference: fit``) are the reference of its check at calibration."""
    then = result.get("speed_check_at_calibration", {}).get("then_s")
    return next(((path, model) for path, model in profiles
                 if then in (model.meta["probe"], probe_reference(model))), None)


def probe_over_fit(cost: StepCostModel) -> dict[int, float]:
    """A profile's probe times over its fit's prices, by the probe's token count: a check's ratio
    against the probe time times this is its ratio against the fit."""
    fit = probe_reference(cost)
    return probe_by_tokens({label: cost.meta["probe"][label] / t for label, t in fit.items()})


def both_references(sizes: dict, to_fit: dict[int, float], stored_fit: bool) -> dict[str, dict[int, float]]:
    """One check's ratios by probe token count (`sizes`, as saved: against the fit if `stored_fit`, else
    against the probe times) against each reference, for the probes `to_fit` (`probe_over_fit`) has."""
    ratios = {int(n): r for n, r in sizes.items() if int(n) in to_fit}
    return {"fit": {n: r * (1 if stored_fit else to_fit[n]) for n, r in ratios.items()},
            "probe": {n: r / (to_fit[n] if stored_fit else 1) for n, r in ratios.items()}}


def pairs(result: dict, profiles: list[tuple[Path, StepCostModel]]) -> dict[str, list[tuple[float, float]]]:
    """(speed check factor, the profile's step-cost error on the run's trace) per real run, by the
    check's reference: "probe" and "fit" for the runs whose profile is in `profiles` (each run's probe
    ratios taken against the other reference through the profile's probe times over its fit's prices),
    and `EVERY` for every run checked against the probe times, its profile there or not (see the
    module's doc)."""
    reference = result.get("speed_reference", "probe")   # the older results' checks: against the probe times
    found = profile_of(result, profiles)
    to_fit = probe_over_fit(found[1]) if found is not None else {}
    out: dict[str, list[tuple[float, float]]] = {}
    for row in result["families"]:
        errors = row.get("step_error_profile", {})
        per_run = [r["error"] for r in errors.get("per_run", [])] or [errors.get("error")]
        factors = row.get("speed_factors") or [row.get("speed_factor")]
        by_tokens = row.get("speed_by_tokens") or [{}] * len(factors)
        for s, sizes, e in zip(factors, by_tokens, per_run):
            if not s or e is None or e <= -1:
                continue
            if reference == "probe":
                out.setdefault(EVERY, []).append((s, e))
            for ref, ratios in both_references(sizes, to_fit, reference == "fit").items():
                if ratios:   # the same runs both ways
                    out.setdefault(ref, []).append((statistics.median(ratios.values()), e))
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


def summarize(results: dict[str, list[tuple[float, float]]]) -> dict:
    """The exponent and mean absolute step errors over every run of `results` (name -> pairs), and
    with more than one result each one's runs priced with the exponent of the others."""
    every = [p for data in results.values() for p in data]
    row = {"results": {}, "runs": len(every), "exponent": exponent(every),
           "mean_abs_error": {"as profiled": mean_abs(every, 0.0), "rescaled": mean_abs(every, 1.0)}}
    if len(results) > 1:
        held = []
        for name, data in results.items():
            c = exponent([p for other, d in results.items() if other != name for p in d])
            held += [(s, e, c) for s, e in data]
            row["results"][name] = {"runs": len(data), "exponent_of_others": c,
                                    "as profiled": mean_abs(data, 0.0), "rescaled": mean_abs(data, 1.0),
                                    "partly rescaled": mean_abs(data, c)}
        row["mean_abs_error"]["partly rescaled"] = statistics.fmean(rescaled_error(*run) for run in held)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="*", help="sim_calibration result JSONs (default: all in benchmarks/results)")
    ap.add_argument("--profiles", default=str(RESULTS / "profiles"),
                    help="profiles of older results, to take their checks again against the profile's fit")
    ap.add_argument("--name", default="speed_checks", help="results JSON name")
    args = ap.parse_args()
    paths = [Path(p) for p in args.results] or sorted(RESULTS.glob("sim_calibration*.json"))
    profiles = load_profiles(Path(args.profiles))
    by_machine: dict[str, dict[str, dict[str, list]]] = {}
    for path in paths:
        result = json.loads(path.read_text())
        # Per machine and thread count: one thread's steps move differently (machine_steadiness.py).
        key = f"{result['machine']['cpu_family']}, {result['machine'].get('threads', '?')} threads"
        for reference, data in pairs(result, profiles).items():
            by_machine.setdefault(key, {}).setdefault(reference, {})[path.stem] = data
    machines = {}
    for cpu, references in by_machine.items():
        machines[cpu] = {reference: summarize(results) for reference, results in sorted(references.items())}
        print(cpu, {ref: {k: v for k, v in row.items() if k != "results"} for ref, row in machines[cpu].items()},
              flush=True)

    def summary(reference: str, row: dict) -> str:
        errs = row["mean_abs_error"]
        text = (f"against the {reference}: {row['runs']} runs, step cost followed the check's factor to the power "
                f"{row['exponent']:.2f}; mean |step error| {100 * errs['as profiled']:.1f}% as profiled, "
                f"{100 * errs['rescaled']:.1f}% rescaled by the factor")
        if "partly rescaled" in errs:
            text += f", {100 * errs['partly rescaled']:.1f}% by factor^c (c of the other results)"
        return text

    save(args.name, {"results": [str(p) for p in paths], "machines": machines},
         "speed check before a run vs the profile's step-cost error during it: "
         + "; ".join(f"{cpu}, " + "; ".join(summary(ref, row) for ref, row in refs.items())
                     for cpu, refs in machines.items()))


if __name__ == "__main__":
    sys.exit(main())
