"""A speed check of one round against one of several, on the same real runs.

`sim_calibration.py` (since run 14) times each speed check's probe steps in several rounds
(``--check-rounds``) and saves every round's times (``speed_checks`` per row). This re-simulates the
result's cells (the same workloads and seeds, its real runs' percentiles as saved) with the profile
scaled by size by each run's check taken five ways: each of the first three rounds alone, the median
of the three (what ``speed_check`` gives) and their minimum, and with ``--traces`` prices the runs'
steps under each. Cells meeting every target of issue 20 (p50s within 15%, p90s within 25%,
throughput within 5%; the forced-preemption cell, beyond saturation, left out). No real runs.

    python benchmarks/check_rounds.py results/sim_calibration_x.json [--traces DIR] [--profiles DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from common import RESULTS, save
from sim_calibration import summary_text, within
from sim_recheck import engines, result_and_profile, resimulate
from conveyor.profile import probe_by_tokens

WAYS = ("round 1", "round 2", "round 3", "median of 3", "min of 3")


def ways(check: dict) -> dict[str, dict[int, float]]:
    """A saved check's ratios by step size, taken each of the five ways."""
    then = check["then_s"]
    rounds = [probe_by_tokens({k: t / then[k] for k, t in times.items() if then.get(k)})
              for times in check["rounds_s"][:3]]
    out = {f"round {i + 1}": r for i, r in enumerate(rounds)}
    out["median of 3"] = {n: statistics.median(r[n] for r in rounds) for n in rounds[0]}
    out["min of 3"] = {n: min(r[n] for r in rounds) for n in rounds[0]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("result", help="a sim_calibration result JSON made with --check-rounds 3 or more")
    ap.add_argument("--profiles", default=str(RESULTS / "profiles"), help="where the result's profile is")
    ap.add_argument("--traces", help="the result's --traces folder (prices the real runs' steps)")
    args = ap.parse_args()
    result, path, cost = result_and_profile(args.result, args.profiles)
    if result.get("check_rounds", 1) < 3:
        raise SystemExit("the result's checks have fewer than three rounds (sim_calibration.py --check-rounds 3)")
    rows, summary = resimulate(result, engines(result), args.traces, lambda row: [
        {way: cost.scaled(statistics.median(sizes.values()), sizes) for way, sizes in ways(check).items()}
        for check in row["speed_checks"]])
    stem = Path(args.result).stem
    save(f"check_rounds_{stem}", {"result": args.result, "profile": str(path), "families": rows,
                                  "summary": summary},
         f"{stem}: the profile scaled by size by each run's check taken from one round or from three, cells "
         f"meeting every target of {len(within(rows))} (p50s): "
         + ", ".join(summary_text(summary, w) for w in WAYS))


if __name__ == "__main__":
    sys.exit(main())
