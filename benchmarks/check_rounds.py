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
from sim_recheck import cell, engines, judged, met, result_and_profile

WAYS = ("round 1", "round 2", "round 3", "median of 3", "min of 3")


def by_tokens(then: dict[str, float], now: dict[str, float]) -> dict[int, float]:
    """A round's ratio per probe step, by the step's token count (``decode 8@128`` -> 8)."""
    return {int(label.split()[1].split("@")[0]): now[label] / then[label] for label in now if then.get(label)}


def ways(check: dict) -> dict[str, dict[int, float]]:
    rounds = [by_tokens(check["then_s"], r) for r in check["rounds_s"][:3]]
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
    engine, small = engines(result)
    rows, counts = [], {w: {"every": 0, "step_errors": []} for w in WAYS}
    for row in result["families"]:
        name = row["family"]
        eng, specs, steps = cell(result, row, engine, small, args.traces)
        per_run = [ways(check) for check in row["speed_checks"]]
        out = {"family": name}
        for way in WAYS:
            rel = judged(specs, eng, [cost.scaled(statistics.median(w[way].values()), w[way]) for w in per_run],
                         row["real"], steps)
            out[way] = rel
            if "150%" not in name:
                counts[way]["every"] += met(rel)[1]
                if "step_error" in rel:
                    counts[way]["step_errors"].append(abs(rel["step_error"]))
        rows.append(out)
        print(f"{name:28s}", " | ".join(f"{w}: {100 * out[w]['ttft_p50']:+.0f} {100 * out[w]['tpot_p50']:+.0f}"
                                        for w in WAYS), flush=True)
    summary = {w: {"every": c["every"],
                   "mean_abs_step_error": statistics.fmean(c["step_errors"]) if c["step_errors"] else None}
               for w, c in counts.items()}
    print(summary, flush=True)
    cells = sum("150%" not in r["family"] for r in rows)

    def text(w: str) -> str:
        s = summary[w]
        step = f", step {100 * s['mean_abs_step_error']:.1f}%" if s["mean_abs_step_error"] is not None else ""
        return f"{w} {s['every']}{step}"

    stem = Path(args.result).stem
    save(f"check_rounds_{stem}", {"result": args.result, "profile": str(path), "families": rows,
                                  "summary": summary},
         f"{stem}: the profile scaled by size by each run's check taken from one round or from three, cells "
         f"meeting every target of {cells}: " + ", ".join(text(w) for w in WAYS))


if __name__ == "__main__":
    sys.exit(main())
