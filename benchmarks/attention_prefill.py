"""A prompt's attention, one layer: the batch-invariant path (the paged decode kernel, query by
query, as `CpuPagedAttention.rowwise_prefill` calls it) against SDPA on the same numbers.

    python benchmarks/attention_prefill.py [--lengths 256,1000,2000] [--rounds 7]

The demo model's attention shape (9 query heads, 3 KV heads, head_dim 64), an empty cache of
16-token blocks in shuffled order, a whole prompt as one chunk; fp32 and bf16 (cache and queries).
The two paths alternate within each round; medians. Writes benchmarks/results/attention_prefill.json
and a line in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, save  # noqa: E402


def main() -> None:
    import torch
    import torch.nn.functional as F

    from conveyor.model.cpu_kernels import load_cpu_kernels

    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="256,1000,2000")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("the C++ kernels are not available here")
    H, KVH, d, bs = 9, 3, 64, 16
    scale = d ** -0.5
    g = torch.Generator().manual_seed(0)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for n in (int(x) for x in args.lengths.split(",")):
            blocks = -(-n // bs)
            k_cache = torch.randn(KVH, blocks + 4, bs, d, generator=g).to(dtype)
            v_cache = torch.randn(KVH, blocks + 4, bs, d, generator=g).to(dtype)
            table = torch.randperm(blocks + 4, generator=g)[:blocks]
            q = torch.randn(n, H, d, generator=g).to(dtype)
            k = k_cache[:, table].reshape(KVH, -1, d)[:, :n].unsqueeze(0)
            v = v_cache[:, table].reshape(KVH, -1, d)[:, :n].unsqueeze(0)
            lens = torch.arange(1, n + 1)
            paths = {
                "rowwise": lambda: kernels.paged_decode(q, k_cache, v_cache, table.unsqueeze(0).expand(n, -1), lens,
                                                        scale, 0),
                "sdpa": lambda: F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k, v, is_causal=True,
                                                               scale=scale, enable_gqa=True),
            }
            ref = paths["sdpa"]()[0].transpose(0, 1).float()
            err = (paths["rowwise"]().float() - ref).abs().max().item()
            times = {name: [] for name in paths}
            for _ in range(args.rounds):
                for name, fn in paths.items():
                    t = time.perf_counter()
                    fn()
                    times[name].append(1e3 * (time.perf_counter() - t))
            med = {name: statistics.median(ts) for name, ts in times.items()}
            row = {"dtype": str(dtype).split(".")[-1], "tokens": n, "ms": times, "median_ms": med,
                   "ratio": med["rowwise"] / med["sdpa"], "max_abs_diff": err}
            rows.append(row)
            print(f"{row['dtype']:>8} {n:5d} tokens: query by query {med['rowwise']:.2f} ms, SDPA {med['sdpa']:.2f} ms "
                  f"({row['ratio']:.2f}x); max |diff| {err:.1e}", flush=True)
    mach = machine()
    line = (f"one layer's prompt attention (9/3 heads, d 64), {mach['cpu_family']}: query by query / SDPA "
            + ", ".join(f"{r['dtype']} {r['tokens']} {r['ratio']:.2f}x" for r in rows))
    save("attention_prefill", {"rows": rows, "rounds": args.rounds}, line)


if __name__ == "__main__":
    main()
