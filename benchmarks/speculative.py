"""Speculative decoding (n-gram prompt lookup) against none, on the demo model, in one run.

Two chat workloads: (a) edit/quote -- each prompt is a slice of this repository's own source with
an instruction to repeat it, so the output copies the prompt (where prompt lookup should pay);
(b) free chat -- short open questions, where it mostly should not. For each dtype, batch size and
workload, the same requests run with speculation off and on (adaptive: the cost model picks the
drafts), interleaved over rounds; greedy, a fixed output length. Reports output tok/s (median
over rounds), the ratio, whether the greedy outputs were equal, and the acceptance counters.

    .venv/bin/python benchmarks/speculative.py [--dtypes auto float32] [--batches 1 4 16 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save  # noqa: E402

from conveyor import LLM, SamplingParams  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
QUESTIONS = ["Tell me about the moon.", "What is a good name for a dog?", "Why is the sky blue?",
             "Give me advice for a job interview.", "What do cats eat?", "How do airplanes fly?",
             "Write a haiku about rain.", "What is the capital of Italy?"]


def edit_prompts(n: int) -> list[str]:
    """n slices of ~600 characters of the repository's Python source, each to be repeated."""
    text = "".join(p.read_text() for p in sorted((REPO / "conveyor" / "scheduler").glob("*.py")))
    out = []
    for i in range(n):
        start = (i * 1237) % (len(text) - 700)
        start = text.index("\n", start) + 1
        out.append([{"role": "user", "content": "Repeat this code exactly, with no changes:\n```python\n"
                                                f"{text[start:start + 600]}\n```"}])
    return out


def chat_prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + (f" (question {i})" if i >= len(QUESTIONS)
                                                                         else "")}] for i in range(n)]


def run(llm: LLM, prompts: list[list[dict]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = llm.chat(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    return sum(map(len, tokens)) / elapsed, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["auto", "float32"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16, 64])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--num-speculative-tokens", type=int, default=5)
    ap.add_argument("--name", default="speculative")
    args = ap.parse_args()
    spec_cfg = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    results = []
    for dtype in args.dtypes:
        engines = {"off": LLM(dtype=dtype, max_num_seqs=64), "ngram": LLM(dtype=dtype, max_num_seqs=64,
                                                                          speculative_config=spec_cfg)}
        for llm in engines.values():   # warm-up (kernels, probes)
            llm.chat(edit_prompts(2), SamplingParams(max_tokens=16), use_tqdm=False)
        for workload, make in (("edit", edit_prompts), ("chat", chat_prompts)):
            for batch in args.batches:
                prompts = make(batch)
                speeds: dict[str, list[float]] = {"off": [], "ngram": []}
                outputs, counters = {}, {}
                for _ in range(args.rounds):
                    for mode, llm in engines.items():
                        spec = llm.engine.core.scheduler.speculator
                        before = spec.snapshot() if spec else None
                        speed, outputs[mode] = run(llm, prompts, params)
                        speeds[mode].append(speed)
                        if spec:
                            after = spec.snapshot()
                            counters = {k: after[k] - before[k] for k in
                                        ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
                off, on = statistics.median(speeds["off"]), statistics.median(speeds["ngram"])
                row = {"dtype": dtype, "workload": workload, "batch": batch, "off_tok_s": round(off, 1),
                       "ngram_tok_s": round(on, 1), "ratio": round(on / off, 3), "rounds": speeds,
                       "same_outputs": outputs["off"] == outputs["ngram"], **counters,
                       "acceptance": round(counters["num_accepted_tokens"] / counters["num_draft_tokens"], 3)
                       if counters.get("num_draft_tokens") else None}
                results.append(row)
                print(row, flush=True)
        for llm in engines.values():
            llm.close()
    summary = ", ".join(f"{r['dtype']} {r['workload']} b{r['batch']} {r['ratio']:.2f}x" for r in results)
    save(args.name, {"config": {"speculative_config": spec_cfg, "max_tokens": args.max_tokens,
                                "rounds": args.rounds}, "results": results},
         f"n-gram speculation vs none, demo model, output tok/s ratio: {summary}")


if __name__ == "__main__":
    main()
