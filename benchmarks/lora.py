"""Multi-LoRA throughput: the same offline batch on the demo model with every request under one of K
random rank-r adapters (K = 1, 4, 16; adapters assigned round-robin, max_loras = K, all in the
batch together) against the base model alone, in one run, interleaved rounds, medians; prefix
caching off (the rounds repeat the prompts).

The adapters are random PEFT adapters of the demo model's shapes (every projection, rank 8), written
with peft; their weights do not change the cost, only their shapes do.

    python benchmarks/lora.py [--rounds 2] [--requests 64]

Writes benchmarks/results/lora.json and a line in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from common import machine, save
from conveyor.engine.llm import LLM
from conveyor.lora.request import LoRARequest
from conveyor.model.loader import demo_model_path, model_directory, read_config
from conveyor.sampling.params import SamplingParams


def write_adapters(root: Path, count: int, rank: int) -> list[LoRARequest]:
    """`count` random adapters of the demo model's shapes (peft over a random HF model of its config)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = read_config(model_directory(demo_model_path(), weights=False))
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, tie_word_embeddings=True))
    loras = []
    for i in range(count):
        torch.manual_seed(i)
        model = get_peft_model(hf, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                              init_lora_weights=False))
        model.save_pretrained(root / f"a{i}")
        hf = model.unload()   # the base back, without the adapter's layers
        loras.append(LoRARequest(f"a{i}", i + 1, str(root / f"a{i}")))
    return loras


def prompts(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(1000, 30000, (64 + (i * 37) % 192,), generator=g).tolist()}
            for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    counts = [0, 1, 4, 16]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    batch = prompts(args.requests)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_adapters(Path(tmp), max(counts), args.rank)
        # no prefix caching: every round sends the same prompts, and hits would favour the later runs
        llm = LLM(dtype=args.dtype, enable_lora=True, max_loras=max(counts), enable_prefix_caching=False)
        llm.generate(batch[:4], params, lora_request=adapters[:4])   # warm: kernels, adapters read
        times: dict[int, list[float]] = {k: [] for k in counts}
        for r in range(args.rounds):
            for k in (counts if r % 2 == 0 else counts[::-1]):
                loras = [adapters[i % k] if k else None for i in range(len(batch))]
                t = time.perf_counter()
                outs = llm.generate(batch, params, lora_request=loras, use_tqdm=False)
                times[k].append(time.perf_counter() - t)
                assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outs)
    tokens = args.requests * args.max_tokens
    tok_s = {k: tokens / statistics.median(v) for k, v in times.items()}
    out = {"machine": machine(), "dtype": str(llm.engine.dtype), "rank": args.rank, "requests": args.requests,
           "max_tokens": args.max_tokens, "rounds": args.rounds, "seconds": times,
           "output_tok_s": tok_s, "ratio_to_base": {k: tok_s[k] / tok_s[0] for k in counts}}
    line = (f"demo model ({out['dtype']}), {args.requests} requests x {args.max_tokens} tokens, rank "
            f"{args.rank} on every projection: base {tok_s[0]:.0f} tok/s; 1 / 4 / 16 adapters in the batch "
            + " / ".join(f"{tok_s[k] / tok_s[0]:.2f}x" for k in counts[1:]) + " of the base")
    save("lora", out, line)
    print(line)


if __name__ == "__main__":
    main()
