"""Serving load benchmark: `conveyor bench serve` (see conveyor/bench/serve.py and docs/server.md).

A single run against a running server prints a summary (and writes --out / --plot):

    python benchmarks/serve.py --base-url http://127.0.0.1:8000/v1 --request-rate 2 --num-requests 100

With --sweep and no --out, the sweep is recorded: benchmarks/results/serve.json (summaries
only, no per-request records), the plot docs/img/serve.png and a line in docs/benchmarks.md:

    python benchmarks/serve.py --sweep 0.5,1,2 --num-requests 100 --server-args="--max-num-seqs 64"
"""

from __future__ import annotations

import argparse

from common import ROOT, save
from conveyor.bench.serve import add_arguments, plot_sweep, run_from_args, sweep_line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(ap)
    args = ap.parse_args()
    record = args.sweep and not args.out
    result = run_from_args(args)
    if record:
        for run in result["runs"]:   # per-request records stay out of the repo (use --out to keep them)
            run.pop("requests")
        path = save("serve", result, sweep_line(result))
        print(f"wrote {path}")
        if not args.plot:   # else already drawn there
            img = ROOT / "docs" / "img" / "serve.png"
            img.parent.mkdir(parents=True, exist_ok=True)
            plot_sweep(result, img)
            print(f"wrote {img}")


if __name__ == "__main__":
    main()
