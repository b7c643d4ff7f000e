"""Forward-pass throughput of the model layer vs transformers, and model-FLOPs utilization.

Same fp32 weights (the demo model's converted GGUF) in both. Measured, interleaved A/B:
decode steps of batch 1/8/32/128 at a fixed context, and a 512-token prefill; plus this
machine's dense fp32 matmul rate so the prefill can be stated as a fraction of it (MFU).

    python benchmarks/forward.py [--context 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from common import median_time, save
from conveyor.model.gguf_loader import convert_gguf
from conveyor.model.loader import build_model, demo_model_path, load_weights, read_config
from conveyor.runner.inputs import SeqWork, build_inputs
from conveyor.runner.kv_cache import KVCacheTensors


def matmul_gflops(repeats: int) -> float:
    best = 0.0
    for m, k, n in ((512, 576, 1536), (1024, 1024, 1024), (2048, 2048, 2048)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        t = median_time(lambda: a @ b, repeats)
        best = max(best, 2 * m * k * n / t / 1e9)
    return best


def model_flops(cfg, tokens: int, context: int) -> float:
    """Matmul FLOPs of a forward over `tokens` new tokens, attention over `context` each."""
    per_layer = 2 * cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + 2 * cfg.q_size * cfg.hidden_size \
        + 2 * 3 * cfg.hidden_size * cfg.intermediate_size
    attn = 2 * 2 * cfg.num_attention_heads * cfg.head_dim * context
    return tokens * cfg.num_hidden_layers * (per_layer + attn)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batches", default="1,8,32,128")
    args = ap.parse_args()
    directory = convert_gguf(demo_model_path())
    cfg = read_config(directory)
    weights = load_weights(directory)
    ours = build_model(cfg, weights)
    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    rng = random.Random(0)
    bs, ctx = 16, args.context
    results = {"context": ctx, "decode": [], "backend": type(ours.attn_backend).__name__}

    for batch in [int(b) for b in args.batches.split(",")]:
        nb = -(-(ctx + 1) // bs)
        kv = KVCacheTensors(cfg, batch * nb, bs)
        ids = list(range(batch * nb))
        rng.shuffle(ids)
        work = [SeqWork([rng.randrange(1000)], ctx, ids[i * nb:(i + 1) * nb]) for i in range(batch)]
        inp = build_inputs(work, bs, max_decode_groups=ours.attn_backend.max_decode_groups)
        prompt = torch.randint(0, 1000, (batch, ctx))
        with torch.inference_mode():
            cache = DynamicCache()
            hf(prompt, past_key_values=cache, use_cache=True)
            step_ids = torch.randint(0, 1000, (batch, 1))

            def run_hf():
                hf(step_ids, past_key_values=cache, use_cache=True)
                cache.crop(-1)   # drop the token just added: every call decodes at the same context

            def run_ours():
                ours(inp.input_ids, inp.positions, inp.meta, kv.layers, inp.logits_indices)

            t_ours, t_hf = [], []
            for _ in range(args.repeats):   # interleaved A/B
                t_ours.append(median_time(run_ours, 1))
                t_hf.append(median_time(run_hf, 1))
        o, h = sorted(t_ours)[len(t_ours) // 2], sorted(t_hf)[len(t_hf) // 2]
        row = {"batch": batch, "conveyor_tok_s": batch / o, "transformers_tok_s": batch / h, "speedup": h / o}
        print(row, flush=True)
        results["decode"].append(row)
        del kv, cache

    n = 512
    kv = KVCacheTensors(cfg, n // bs + 1, bs)
    inp = build_inputs([SeqWork([rng.randrange(1000) for _ in range(n)], 0, list(range(n // bs + 1)))], bs)
    x = torch.randint(0, 1000, (1, n))
    with torch.inference_mode():
        t_ours, t_hf = [], []
        for _ in range(args.repeats):
            t_ours.append(median_time(lambda: ours(inp.input_ids, inp.positions, inp.meta, kv.layers,
                                                   inp.logits_indices), 1))
            t_hf.append(median_time(lambda: hf(x, logits_to_keep=1), 1))
    o, h = sorted(t_ours)[len(t_ours) // 2], sorted(t_hf)[len(t_hf) // 2]
    peak = matmul_gflops(args.repeats)
    flops = model_flops(cfg, n, n // 2) + 2 * cfg.hidden_size * cfg.vocab_size
    results["prefill_512"] = {"conveyor_tok_s": n / o, "transformers_tok_s": n / h, "speedup": h / o,
                              "conveyor_gflops": flops / o / 1e9, "matmul_peak_gflops": peak,
                              "mfu": flops / o / 1e9 / peak}
    print(results["prefill_512"])
    d = {r["batch"]: r for r in results["decode"]}
    line = ("decode tok/s " + ", ".join(f"b{b}: {r['conveyor_tok_s']:.0f} vs HF {r['transformers_tok_s']:.0f} "
                                        f"({r['speedup']:.2f}x)" for b, r in d.items())
            + f"; prefill 512: {results['prefill_512']['conveyor_tok_s']:.0f} tok/s "
              f"({results['prefill_512']['speedup']:.2f}x HF), MFU {results['prefill_512']['mfu']:.0%} "
              f"of {peak:.0f} GFLOP/s matmul")
    save("forward", results, line)


if __name__ == "__main__":
    main()
