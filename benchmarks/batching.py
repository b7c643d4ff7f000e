"""Continuous vs static batching on the same engine, and vs transformers' static generate.

Workload: all requests given at once; prompt lengths uniform in [16, 512], output lengths
long-tailed (log-uniform in [8, 512]), greedy with ignore_eos so every system produces the
same useful tokens. Reports output tok/s, mean/p99 latency, batch occupancy per step (plot),
and KV memory: blocks actually used vs static contiguous preallocation.

    python benchmarks/batching.py [--requests 48] [--batch 16] [--skip-hf]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

import torch

from common import ROOT, save
from conveyor.engine.engine import Engine, EngineConfig
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler.config import SchedulerConfig


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(16, 512))]
        out.append((prompt, int(round(math.exp(rng.uniform(math.log(8), math.log(512)))))))
    return out


def p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))]


def run_conveyor(engine: Engine, reqs, policy: str) -> dict:
    engine.scheduler.config.scheduling_policy = policy
    t0 = time.perf_counter()
    for i, (prompt, n_out) in enumerate(reqs):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True),
                           request_id=f"{policy}-{i}")
    latency, trace = {}, []
    bs = engine.kv.block_size
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter() - t0
        for o in outs:
            if o.finished:
                latency[o.request_id] = now
        running = engine.scheduler.running
        stored = sum(r.num_computed_tokens for r in running)
        used = engine.kv.num_blocks - engine.kv.num_free_blocks
        # static preallocation reserves prompt + max_tokens contiguous slots per running request
        static_reserve = sum(r.num_prompt_tokens + r.max_tokens for r in running)
        trace.append({"t": now, "running": len(running), "waiting": len(engine.scheduler.waiting),
                      "tokens_stored": stored, "blocks_used": used, "slots_allocated": used * bs,
                      "static_reserved_slots": static_reserve})
    wall = time.perf_counter() - t0
    n_tok = sum(n for _, n in reqs)
    lat = list(latency.values())
    busy = [s for s in trace if s["slots_allocated"]]
    waste = sum(s["slots_allocated"] - s["tokens_stored"] for s in busy) / max(1, sum(s["slots_allocated"] for s in busy))
    mem_ratio = sum(s["slots_allocated"] for s in busy) / max(1, sum(s["static_reserved_slots"] for s in busy))
    return {"policy": policy, "wall_s": wall, "output_tok_s": n_tok / wall, "mean_latency_s": statistics.mean(lat),
            "p99_latency_s": p99(lat), "steps": len(trace), "kv_waste_frac": waste,
            "kv_used_vs_static_prealloc": mem_ratio,
            "peak_kv_slots": max(s["slots_allocated"] for s in trace),
            "peak_static_reserved_slots": max(s["static_reserved_slots"] for s in trace),
            "trace": trace}


def run_hf(reqs, batch: int, directory) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    t0 = time.perf_counter()
    latency = []
    with torch.inference_mode():
        for i in range(0, len(reqs), batch):
            chunk = reqs[i:i + batch]
            width = max(len(p) for p, _ in chunk)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])       # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
            new = max(n for _, n in chunk)  # one static batch runs until its longest member is done
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=0)
            latency += [time.perf_counter() - t0] * len(chunk)
    wall = time.perf_counter() - t0
    return {"policy": "transformers-static", "wall_s": wall, "output_tok_s": sum(n for _, n in reqs) / wall,
            "mean_latency_s": statistics.mean(latency), "p99_latency_s": p99(latency)}


def plot(results: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for name, style in (("continuous", "-"), ("static", "--")):
        tr = results[name]["trace"]
        axes[0].plot([s["t"] for s in tr], [s["running"] for s in tr], style, label=name)
        axes[1].plot([s["t"] for s in tr], [s["slots_allocated"] for s in tr], style, label=f"{name}: KV slots used")
    tr = results["continuous"]["trace"]
    axes[1].plot([s["t"] for s in tr], [s["static_reserved_slots"] for s in tr], ":",
                 label="continuous: if preallocated (prompt+max_tokens)")
    axes[0].set(xlabel="seconds", ylabel="sequences in the batch", title="Batch occupancy")
    axes[1].set(xlabel="seconds", ylabel="KV token slots", title="KV memory")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--batch", type=int, default=16, help="max_num_seqs, and HF's static batch size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    reqs = workload(args.requests, args.seed)
    sched = SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=1024, admission_policy="conservative")
    engine = Engine(EngineConfig(kv_cache_gib=2.0, scheduler=sched))
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))   # warm-up (kernel build, allocator)
    while engine.has_unfinished_requests():
        engine.step()
    results = {"workload": {"requests": args.requests, "prompt_len": [16, 512], "output_len": [8, 512],
                            "output_tokens": sum(n for _, n in reqs)}, "max_num_seqs": args.batch}
    for policy in ("continuous", "static"):
        results[policy] = run_conveyor(engine, reqs, policy)
        print({k: v for k, v in results[policy].items() if k != "trace"}, flush=True)
    if not args.skip_hf:
        from conveyor.model.gguf_loader import convert_gguf
        from conveyor.model.loader import demo_model_path

        results["transformers"] = run_hf(reqs, args.batch, convert_gguf(demo_model_path()))
        print(results["transformers"], flush=True)
    png = ROOT / "docs" / "img" / "batching.png"
    plot(results, png)
    c, s = results["continuous"], results["static"]
    line = (f"{args.requests} reqs, batch {args.batch}: continuous {c['output_tok_s']:.1f} tok/s vs static "
            f"{s['output_tok_s']:.1f} ({c['output_tok_s'] / s['output_tok_s']:.2f}x)")
    if "transformers" in results:
        line += f" vs HF generate {results['transformers']['output_tok_s']:.1f}"
    line += (f"; p99 latency {c['p99_latency_s']:.0f}s vs {s['p99_latency_s']:.0f}s; KV waste "
             f"{c['kv_waste_frac']:.1%}, KV used = {c['kv_used_vs_static_prealloc']:.0%} of static preallocation")
    save("batching", results, line)


if __name__ == "__main__":
    main()
