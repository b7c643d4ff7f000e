"""Speculative decoding (n-gram prompt lookup) against none, on the demo model, in one run.

Three workloads: (a) copy -- a completion prompt of a slice of this repository's own source and the
start of "the same code, reformatted", which the model continues by copying (quote-heavy: where
prompt lookup should pay); (b) edit -- the same slices in a chat asking for type hints and the whole
code back (an edit: much is copied, some changed); (c) chat -- short open questions, where it should not.
For each dtype, batch size and workload, the same requests run with speculation off, on (adaptive:
the cost model picks the drafts; the default) and on with every match drafted up to 5 (fixed),
interleaved over rounds; greedy, a fixed output length. Reports output tok/s (median over rounds),
the ratios to off, whether the greedy outputs were equal, and the acceptance counters.

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
        out.append([{"role": "user", "content": "Add type hints to this code and return the whole code:\n"
                                                f"```python\n{text[start:start + 600]}\n```"}])
    return out


def copy_prompts(n: int) -> list[str]:
    """n completion prompts: a slice of ~700 characters of source, then its first line again."""
    text = "".join(p.read_text() for p in sorted((REPO / "conveyor" / "scheduler").glob("*.py")))
    out = []
    for i in range(n):
        start = text.index("\n", (i * 1237) % (len(text) - 900)) + 1
        body = text[start:start + 700]
        body = body[:body.rindex("\n")]
        out.append(f"```python\n{body}\n```\n\nThe same code, reformatted:\n\n```python\n{body.splitlines()[0]}\n")
    return out


def chat_prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + (f" (question {i})" if i >= len(QUESTIONS)
                                                                         else "")}] for i in range(n)]


def run(llm: LLM, prompts: list, params: SamplingParams) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    if isinstance(prompts[0], str):
        outs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outs = llm.chat(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    return sum(map(len, tokens)) / elapsed, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["auto", "float32"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-speculative-tokens", type=int, default=5)
    ap.add_argument("--name", default="speculative")
    args = ap.parse_args()
    spec_cfg = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
    fixed_cfg = {**spec_cfg, "adaptive": False}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    results = []
    for dtype in args.dtypes:
        engines = {"off": LLM(dtype=dtype, max_num_seqs=64),
                   "ngram": LLM(dtype=dtype, max_num_seqs=64, speculative_config=spec_cfg),
                   "fixed": LLM(dtype=dtype, max_num_seqs=64, speculative_config=fixed_cfg)}
        for llm in engines.values():   # warm-up (kernels, probes)
            llm.chat(edit_prompts(2), SamplingParams(max_tokens=16), use_tqdm=False)
        for workload, make in (("copy", copy_prompts), ("edit", edit_prompts), ("chat", chat_prompts)):
            for batch in args.batches:
                prompts = make(batch)
                speeds: dict[str, list[float]] = {mode: [] for mode in engines}
                outputs, counters = {}, {}
                for r in range(args.rounds):   # (the order alternates from round to round)
                    for mode, llm in (list(engines.items()) if r % 2 == 0 else list(engines.items())[::-1]):
                        spec = llm.engine.core.scheduler.speculator
                        before = spec.snapshot() if spec else None
                        speed, outputs[mode] = run(llm, prompts, params)
                        speeds[mode].append(speed)
                        if spec:
                            after = spec.snapshot()
                            counters[mode] = {k: after[k] - before[k] for k in
                                              ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
                med = {mode: statistics.median(v) for mode, v in speeds.items()}
                row = {"dtype": dtype, "workload": workload, "batch": batch,
                       **{f"{mode}_tok_s": round(v, 1) for mode, v in med.items()},
                       "ratio": round(med["ngram"] / med["off"], 3), "fixed_ratio": round(med["fixed"] / med["off"], 3),
                       "rounds": speeds, "same_outputs": outputs["off"] == outputs["ngram"] == outputs["fixed"],
                       "counters": counters}
                results.append(row)
                print(row, flush=True)
        for llm in engines.values():
            llm.close()
    summary = ", ".join(f"{r['dtype']} {r['workload']} b{r['batch']} {r['ratio']:.2f}x (fixed {r['fixed_ratio']:.2f}x)"
                        for r in results)
    save(args.name, {"config": {"speculative_config": spec_cfg, "fixed": fixed_cfg, "max_tokens": args.max_tokens,
                                "rounds": args.rounds}, "results": results},
         f"n-gram speculation (adaptive; fixed 5) vs none, demo model, chat, greedy, output tok/s: {summary}")


if __name__ == "__main__":
    main()
