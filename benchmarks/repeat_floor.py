"""How far is the real engine from itself? The floor under a simulator's error near saturation.

`sim_calibration.py` runs every cell between 50% and 100% of its saturation (long prompts aside) a
second time on the real engine, with the same requests, seeds and knobs, and saves the second run's
metrics against the first's (``real_repeat``). This gathers those repeats from the results given
(default: every ``sim_calibration*.json`` in ``results/``) and reports, per group of results (CPU,
torch threads, requests per cell), each metric's median and root-mean-square difference and how
many repeats miss issue 20's targets (TTFT and TPOT p50 within 15%, p90 within 25%, throughput
within 5%):

- **as measured**: one real run against another;
- **a simulator without error**: a simulator that predicts the real runs' mean exactly is off from
  one run by X - mean, whose spread is that of X1 - X2 divided by sqrt(2) when runs vary alike and
  independently; each difference is divided by sqrt(2) and judged again. This is the share of cells
  near saturation that even an exact simulator would be expected to fail here, and from it the
  chance that one run of `sim_calibration.py` passes its four repeated cells (80%, long prompts aside).

No runs: reads JSON.

    python benchmarks/repeat_floor.py [RESULT ...] [--name NAME]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from common import RESULTS, save
from sim_calibration import METRICS, met

NEAR_SATURATION_CELLS = 4   # repeated per sim_calibration.py run: every family at 80% but long prompts


def group_of(result: dict) -> str:
    cpu = result.get("machine", {}).get("cpu", "?")
    threads = result.get("torch_threads") or "all"
    requests = result["workload"]["num_requests"] * (result.get("seeds") or 1)
    return f"{cpu}, {threads} thread(s), {requests} requests per cell"


def judged(repeats: list[dict]) -> dict:
    """Per metric the median and RMS difference; cells missing the p50 targets or any target, as
    measured and for an exact simulator (differences / sqrt(2))."""
    out = {"repeats": len(repeats)}
    for m in METRICS:
        d = [r[m] for r in repeats]
        out[m] = {"median_abs": statistics.median(map(abs, d)), "rms": math.sqrt(statistics.fmean(x * x for x in d))}
    for label, scale in (("measured", 1.0), ("exact_simulator", 1 / math.sqrt(2))):
        verdicts = [met({m: r[m] * scale for m in METRICS}) for r in repeats]
        missed = sum(not every for _, every in verdicts)
        out[label] = {"missed_p50": sum(not p50 for p50, _ in verdicts), "missed_any": missed,
                      "run_passes": (1 - missed / len(repeats)) ** NEAR_SATURATION_CELLS}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="*", help="sim_calibration results (default: all in results/)")
    ap.add_argument("--name", default="repeat_floor", help="results JSON name")
    args = ap.parse_args()
    paths = [Path(p) for p in args.results] or sorted(RESULTS.glob("sim_calibration*.json"))
    groups: dict[str, list[dict]] = {}
    sources: dict[str, list[str]] = {}
    for path in paths:
        result = json.loads(path.read_text())
        repeats = [row["real_repeat"] for row in result["families"] if row.get("real_repeat")]
        if repeats:
            group = group_of(result)
            groups.setdefault(group, []).extend(repeats)
            sources.setdefault(group, []).append(path.name)
    everything = [r for rs in groups.values() for r in rs]
    if not everything:
        raise SystemExit("no real repeats in these results")
    report = {g: {**judged(rs), "results": sources[g]} for g, rs in groups.items()}
    report["all"] = judged(everything)
    for g, r in report.items():
        print(f"{g}: {r['repeats']} repeats; TTFT p50 |d| median {100 * r['ttft_p50']['median_abs']:.1f}%, "
              f"TPOT p50 {100 * r['tpot_p50']['median_abs']:.1f}%; missing a target: measured "
              f"{r['measured']['missed_any']}, exact simulator {r['exact_simulator']['missed_any']} "
              f"(a run passing all {NEAR_SATURATION_CELLS}: {100 * r['exact_simulator']['run_passes']:.0f}%)")
    a = report["all"]
    save(args.name, {"results": [p.name for p in paths], "groups": report},
         f"the real engine against itself near saturation (same requests twice, {a['repeats']} cells of "
         f"{sum(map(len, sources.values()))} sim_calibration results): TTFT / TPOT p50 differ by a median "
         f"{100 * a['ttft_p50']['median_abs']:.1f}% / {100 * a['tpot_p50']['median_abs']:.1f}% (RMS "
         f"{100 * a['ttft_p50']['rms']:.0f}% / {100 * a['tpot_p50']['rms']:.0f}%); {a['measured']['missed_any']} miss "
         f"a target of issue 20, and an exact simulator would be expected to miss "
         f"{a['exact_simulator']['missed_any']} (a run's {NEAR_SATURATION_CELLS} cells near saturation all within "
         f"{100 * a['exact_simulator']['run_passes']:.0f}% of the time)")


if __name__ == "__main__":
    sys.exit(main())
