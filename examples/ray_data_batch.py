"""Batch inference over a JSONL file with ray.data and Conveyor's engine (an actor pool of engines).

    python examples/ray_data_batch.py prompts.jsonl results/ --concurrency 2 --max-tokens 64

Each input line is a JSON object with a "prompt" (text) or "prompt_token_ids", optionally its own
"sampling_params" ({"temperature": 0.7, "seed": 1, ...}); other keys are carried through. The output
directory gets JSONL files with the input columns plus generated_text, generated_token_ids,
num_generated_tokens, num_input_tokens and finish_reason. Ray's progress bars show the pipeline's
progress; RAY_ADDRESS=... runs it on an existing cluster. `--demo N` writes N sample prompts to the
input path first.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("input", help="JSONL file of prompts")
    p.add_argument("output", help="directory for the JSONL results")
    p.add_argument("--model", default=None, help="HF model directory or .gguf (default: the demo model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--concurrency", type=int, default=1, help="engines in the actor pool")
    p.add_argument("--cpus-per-engine", type=float, default=None,
                   help="CPUs each engine actor reserves (default: 1, less when the engines and one read/write "
                        "task would not fit the cluster's CPUs together)")
    p.add_argument("--gpus-per-engine", type=float, default=0)
    p.add_argument("--batch-size", type=int, default=32, help="rows per map_batches call")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--demo", type=int, default=0, metavar="N", help="first write N sample prompts to INPUT")
    args = p.parse_args()

    import ray

    from conveyor.ray.data import process

    if args.demo:
        topics = ["the sea", "a city at night", "an old clock", "rain", "a cat", "mountains", "bread", "a library"]
        with open(args.input, "w", encoding="utf-8") as f:
            for i in range(args.demo):
                f.write(json.dumps({"id": i, "prompt": f"Write one sentence about {topics[i % len(topics)]}:"}) + "\n")
    ray.init(address=os.environ.get("RAY_ADDRESS"))
    threads = max(1, int(args.cpus_per_engine or 1))
    engine = {"model": args.model, "dtype": args.dtype, "torch_threads": threads,
              **({"device": "cuda"} if args.gpus_per_engine else {})}
    start = time.perf_counter()
    try:
        ds = process(ray.data.read_json(args.input), engine, concurrency=args.concurrency,
                     batch_size=args.batch_size, num_cpus=args.cpus_per_engine, num_gpus=args.gpus_per_engine,
                     sampling_params={"max_tokens": args.max_tokens, "temperature": args.temperature})
    except ValueError as e:   # the engines and the read/write tasks cannot fit the cluster: they would wait forever
        raise SystemExit(f"error: {e}") from None
    ds.write_json(args.output)
    rows = 0
    tokens = 0
    for name in os.listdir(args.output):
        with open(os.path.join(args.output, name), encoding="utf-8") as f:
            for line in f:
                rows += 1
                tokens += json.loads(line)["num_generated_tokens"]
    took = time.perf_counter() - start
    print(f"{rows} rows, {tokens} generated tokens in {took:.1f} s ({tokens / took:.1f} tok/s) -> {args.output}")


if __name__ == "__main__":
    main()
