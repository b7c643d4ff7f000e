"""`conveyor` command line: generate (offline batch), serve (OpenAI-compatible HTTP) and bench."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from conveyor.bench.serve import add_parser as add_serve_bench_parser
from conveyor.server.cli import add_serve_parser


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--max-num-seqs", type=int, default=128, help="most sequences in one step's batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=1024, help="token budget of one step")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument("--kv-cache-gib", type=float, default=1.0, help="memory for the KV cache, in GiB")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks (overrides --kv-cache-gib)")
    g.add_argument("--swap-space-gib", type=float, default=0.5, help="host memory for swapped-out KV, in GiB")
    g.add_argument("--preemption-mode", choices=("recompute", "swap", "auto"), default="recompute",
                   help="how a preempted request gives back its KV: recompute later, swap to host, or by cost")
    g.add_argument("--admission-policy", choices=("optimistic", "conservative", "predictive"),
                   default="predictive", help="how much future KV a request must fit before it is admitted")
    g.add_argument("--admission-quantile", type=float, default=0.9,
                   help="predictive admission: quantile of the learned output-length distribution")
    g.add_argument("--reservation-buffer", type=float, default=0.05,
                   help="predictive admission: fraction of KV blocks kept free for growth")
    g.add_argument("--scheduling-policy", choices=("continuous", "static"), default="continuous",
                   help="continuous batching, or a static batch baseline")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share KV blocks of identical prompt prefixes")
    g.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + output tokens")
    g.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    g.add_argument("--seed", type=int, default=0, help="engine seed for requests without their own")
    g.add_argument("--torch-threads", type=int, default=None,
                   help="CPU threads for torch (default: all cores; 1 can be faster when other work shares them)")


def engine_config(args: argparse.Namespace):
    from conveyor.engine.engine import EngineConfig
    from conveyor.scheduler.config import SchedulerConfig

    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                            preemption_mode=args.preemption_mode, admission_policy=args.admission_policy,
                            scheduling_policy=args.scheduling_policy, admission_quantile=args.admission_quantile,
                            reservation_buffer=args.reservation_buffer)
    return EngineConfig(model=args.model, device=args.device, block_size=args.block_size,
                        num_kv_blocks=args.num_kv_blocks, kv_cache_gib=args.kv_cache_gib,
                        swap_space_gib=args.swap_space_gib, max_model_len=args.max_model_len,
                        enable_prefix_caching=args.enable_prefix_caching, seed=args.seed, scheduler=sched)


def read_prompts(path: Path) -> list[str | dict]:
    """One prompt per line, or JSONL objects with a "prompt" (or "prompt_token_ids") field."""
    prompts: list[str | dict] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            obj = json.loads(line)
            prompts.append(obj if "prompt_token_ids" in obj else obj["prompt"])
        else:
            prompts.append(line)
    return prompts


def cmd_generate(args: argparse.Namespace) -> int:
    from conveyor.engine.engine import Engine
    from conveyor.engine.llm import LLM
    from conveyor.sampling.params import SamplingParams

    prompts: list = list(args.prompt)
    if args.file:
        prompts += read_prompts(Path(args.file))
    if not prompts:
        print("error: give a prompt or --file", file=sys.stderr)
        return 2
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sampling_seed, n=args.n)
    llm = LLM.__new__(LLM)
    llm.engine = Engine(engine_config(args))
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params) if args.chat \
        else llm.generate(prompts, params)
    for out in outputs:
        for c in out.outputs:
            if args.json:
                print(json.dumps({"prompt": out.prompt, "text": c.text, "finish_reason": c.finish_reason,
                                  "token_ids": c.token_ids, "error": out.error}))
            elif out.error:
                print(f"error: {out.error}", file=sys.stderr)
            else:
                print(c.text if args.chat else f"{out.prompt}{c.text}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text offline for one or more prompts")
    g.add_argument("prompt", nargs="*", help="prompt text(s)")
    g.add_argument("--model", default=None, help="HF model directory or .gguf file (default: the demo model)")
    g.add_argument("--file", help="read prompts from a file: one per line, or JSONL with a 'prompt' field")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    g.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate per prompt")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("-n", type=int, default=1, help="completions per prompt")
    g.add_argument("--json", action="store_true", help="print one JSON object per completion")
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)
    add_serve_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="benchmark", required=True)
    add_serve_bench_parser(bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
