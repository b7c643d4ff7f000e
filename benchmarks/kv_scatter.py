"""What a sequence's KV blocks lying scattered over the cache cost a decode step, with and without
paged attention's L2 prefetch, in the same run.

A serving engine's block tables are scattered once requests have come and gone: a sequence's
blocks are wherever free ones were. One block of one KV head is 2 KiB (bf16, 16 tokens, head_dim
64), so the hardware prefetcher, which follows address streams, starts over every 2 KiB, while a
table of consecutive blocks reads each head's K and V as one stream. csrc/paged_attention_cpu.cpp
asks for rows one block ahead into L1 and (``set_attn_prefetch(n)``, default 64) n tokens ahead
into L2; this script times whole decode steps of the engine's ModelRunner (the demo model by
default) with consecutive and with shuffled tables (``conveyor.profile._Plans``, ``scattered``),
with the L2 prefetch off (0: the kernel before 2026-12-06) and on, all four in alternation, ROUNDS
rounds, medians of STEPS steps each; ratios are taken round by round (the machine drifts).

    python benchmarks/kv_scatter.py [--dtype bfloat16] [--ahead 64] [--shapes 1x128,1x1500,8x1024,16x512]
                                    [--name kv_scatter]
"""

from __future__ import annotations

import argparse
import statistics

from common import median_time, save
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
from conveyor.model.cpu_kernels import load_cpu_kernels
from conveyor.profile import _Plans

ROUNDS = 5
STEPS = 15


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ahead", type=int, default=64, help="tokens ahead the L2 prefetch asks for rows")
    ap.add_argument("--shapes", default="1x128,1x1500,8x1024,16x512", help="sequences x tokens of context")
    ap.add_argument("--name", default="kv_scatter", help="results file name (benchmarks/results/NAME.json)")
    args = ap.parse_args()
    kernels = load_cpu_kernels()
    if kernels is None or kernels.attn_prefetch() == 0:
        raise SystemExit("the AVX-512 paged attention kernel is not built here: nothing to compare")
    engine = Engine(EngineConfig.from_options(dtype=args.dtype, max_num_seqs=32, max_num_batched_tokens=2048,
                                              cost_model="none"))
    tables = {"consecutive": _Plans(engine, prefix="c", scattered=False),
              "scattered": _Plans(engine, prefix="s", run=1)}   # every block on its own
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    plans = {(name, shape): p.plan([p.seq(shape[1], 1) for _ in range(shape[0])])
             for name, p in tables.items() for shape in shapes}
    variants = [(name, ahead) for ahead in (0, args.ahead) for name in tables]
    times: dict = {(v, shape): [] for v in variants for shape in shapes}
    for _ in range(ROUNDS):
        for shape in shapes:
            for name, ahead in variants:
                kernels.set_attn_prefetch(ahead)
                plan = plans[(name, shape)]
                times[((name, ahead), shape)].append(median_time(lambda: engine.runner.execute(plan), STEPS, 2))
    kernels.set_attn_prefetch(args.ahead)
    rows = {}
    for shape in shapes:
        t = {v: times[(v, shape)] for v in variants}

        def ratio(a, b):   # round by round
            return statistics.median(x / y for x, y in zip(t[a], t[b]))

        rows[f"{shape[0]}x{shape[1]}"] = {
            "step_ms": {f"{name}, ahead {a}": 1e3 * statistics.median(t[(name, a)]) for name, a in variants},
            "scattered_over_consecutive": {
                ahead: ratio(("scattered", ahead), ("consecutive", ahead)) for ahead in (0, args.ahead)},
            "prefetch_off_over_on": {name: ratio((name, 0), (name, args.ahead)) for name in tables}}
        print(shape, rows[f"{shape[0]}x{shape[1]}"], flush=True)
    on = f"scattered, ahead {args.ahead}"
    line = f"{args.dtype} decode steps, scattered / consecutive block tables with the L2 prefetch off -> " \
        f"{args.ahead} tokens ahead: " + "; ".join(
            f"{s}: " + " -> ".join(f"{r['scattered_over_consecutive'][a]:.2f}x" for a in (0, args.ahead)) +
            f" (scattered {r['step_ms']['scattered, ahead 0']:.1f} -> {r['step_ms'][on]:.1f} ms)"
            for s, r in rows.items())
    save(args.name, {"rounds": ROUNDS, "steps": STEPS, "ahead": args.ahead, "rows": rows}, line)


if __name__ == "__main__":
    main()
