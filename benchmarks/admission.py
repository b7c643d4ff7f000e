"""The admission trade-off, measured: preemptions vs queueing for each policy and knob.

Runs the real scheduler and KV manager in the simulator (conveyor/sim) on a workload whose
output lengths are long-tailed while max_tokens is generous (the usual case: clients set
max_tokens high, most answers are short), with a KV pool too small for everyone at
max_tokens. Sweeps optimistic, conservative, and predictive over quantile q and buffer.

    python benchmarks/admission.py [--requests 1000] [--rate 0.6]
"""

from __future__ import annotations

import argparse
import math
import random

from common import save
from conveyor.scheduler.config import SchedulerConfig
from conveyor.sim.simulator import SimRequest, simulate


def workload(n: int, rate: float, seed: int) -> list[SimRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        length = min(1024, int(math.exp(rng.gauss(math.log(60), 1.0))) + 1)   # lognormal, median ~60
        out.append(SimRequest(t, rng.randint(16, 512), length, max_tokens=1024))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rate", type=float, default=0.6, help="arrivals per second")
    ap.add_argument("--blocks", type=int, default=600, help="KV blocks of 16 tokens")
    args = ap.parse_args()
    wl = workload(args.requests, args.rate, 0)
    configs = [("optimistic", {}), ("conservative", {})]
    configs += [("predictive", {"admission_quantile": q, "reservation_buffer": b})
                for q in (0.5, 0.8, 0.9, 0.99) for b in (0.0, 0.05, 0.1)]
    rows = []
    for policy, knobs in configs:
        cfg = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024, admission_policy=policy, **knobs)
        res = simulate(wl, cfg, num_blocks=args.blocks)
        row = {"policy": policy, **knobs, **res.summary()}
        rows.append(row)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    by = {(r["policy"], r.get("admission_quantile"), r.get("reservation_buffer")): r for r in rows}
    o, c, p = by[("optimistic", None, None)], by[("conservative", None, None)], by[("predictive", 0.9, 0.05)]
    line = (f"{args.requests} simulated reqs at {args.rate}/s, {args.blocks} blocks: preemptions optimistic "
            f"{o['num_preemptions']} / predictive(q=.9,b=.05) {p['num_preemptions']} / conservative "
            f"{c['num_preemptions']}; mean TTFT {o['mean_ttft_s']:.1f}s / {p['mean_ttft_s']:.1f}s / "
            f"{c['mean_ttft_s']:.1f}s; tok/s {o['output_tok_s']:.0f} / {p['output_tok_s']:.0f} / "
            f"{c['output_tok_s']:.0f}")
    save("admission", {"workload": {"requests": args.requests, "rate": args.rate, "blocks": args.blocks,
                                    "output_len": "lognormal median 60, cap 1024", "max_tokens": 1024},
                       "rows": rows}, line)


if __name__ == "__main__":
    main()
