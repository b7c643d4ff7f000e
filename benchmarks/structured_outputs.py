"""Structured outputs: which grammar library, and what a constraint costs in throughput.

    python benchmarks/structured_outputs.py [--rounds 2] [--dtype auto]

1. Library comparison on the demo vocabulary (49,152 tokens), one JSON schema and one regex:
   compile time (schema -> matcher ready for the first mask) and per-token mask time along a
   valid output, for llguidance and outlines-core (both dependency-free wheels on PyPI).
   xgrammar is not measured: its wheel requires transformers and triton at run time, which
   Conveyor does not want as serving dependencies.
2. Throughput of the reference workload (64 requests, prompts 32-256 random token ids, outputs
   16-256, greedy) unconstrained vs every request under a json_schema constraint (an object with
   an array of at least 500 short strings, so every output runs to its max_tokens) vs every request
   asking prompt_logprobs=1, interleaved, offline through LLM.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import save  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
SAMPLE = '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines", "notes", "computing"]}'
REGEX = r"[0-9]{3}-[0-9]{3}-[0-9]{4}"
# minItems keeps every constrained output going until its max_tokens, as the unconstrained ones do:
# the same number of tokens on both sides, so tok/s compares the per-token cost.
LONG = {"type": "object", "properties": {"items": {"type": "array", "minItems": 500,
                                                   "items": {"type": "string", "maxLength": 12}}},
        "required": ["items"], "additionalProperties": False}


def tokenizer_dir() -> Path:
    from conveyor.model.loader import demo_model_path, model_directory

    return model_directory(demo_model_path())


def bench_llguidance(tok_json: str, ids: list[int], regex_ids: list[int]) -> dict:
    import llguidance
    import torch

    t = time.perf_counter()
    tok = llguidance.LLTokenizer(tok_json, eos_token=2)
    tokenizer_s = time.perf_counter() - t
    mask = torch.empty((1, (tok.vocab_size + 31) // 32), dtype=torch.int32)
    ex = llguidance.LLExecutor()
    out = {"tokenizer_s": tokenizer_s}
    for name, grammar, seq in (("json", llguidance.LLMatcher.grammar_from_json_schema(SCHEMA), ids),
                               ("regex", llguidance.LLMatcher.grammar_from_regex(REGEX), regex_ids)):
        t = time.perf_counter()
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        ex.unsafe_compute_mask_ptr([(m, 0)], mask.data_ptr(), mask.shape[1] * 4, 1)
        compile_s = time.perf_counter() - t
        assert m.consume_token(seq[0])
        times = []
        for tid in seq[1:]:
            t = time.perf_counter()
            ex.unsafe_compute_mask_ptr([(m, 0)], mask.data_ptr(), mask.shape[1] * 4, 1)
            times.append(time.perf_counter() - t)
            assert (int(mask[0, tid // 32]) >> (tid % 32)) & 1, "a valid token was masked out"
            assert m.consume_token(tid)
        out[name] = {"compile_ms": compile_s * 1e3, "mask_us_median": statistics.median(times) * 1e6,
                     "mask_us_max": max(times) * 1e6}
    return out


def bench_outlines(hf_tok, ids: list[int], regex_ids: list[int]) -> dict:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    # outlines-core wants {token text: [ids]}; byte-level BPE texts are decoded per token
    # (tokens that are partial UTF-8 sequences get replacement characters: fine for timing).
    t = time.perf_counter()
    vocab: dict[str, list[int]] = {}
    for i in range(hf_tok.get_vocab_size()):
        if i == 2:
            continue
        vocab.setdefault(hf_tok.decode([i], skip_special_tokens=False), []).append(i)
    vocabulary = outlines_core.Vocabulary(2, vocab)
    out = {"vocabulary_s": time.perf_counter() - t}
    for name, regex, seq in (("json", build_regex_from_schema(json.dumps(SCHEMA)), ids), ("regex", REGEX, regex_ids)):
        t = time.perf_counter()
        index = outlines_core.Index(regex, vocabulary)
        guide = outlines_core.Guide(index)
        guide.get_tokens()
        compile_s = time.perf_counter() - t
        times, followed = [], 0
        for tid in seq:
            t = time.perf_counter()
            allowed = guide.get_tokens()
            times.append(time.perf_counter() - t)
            if tid not in allowed:   # the tokenization of the sample may differ from outlines' paths
                break
            guide.advance(tid)
            followed += 1
        out[name] = {"compile_ms": compile_s * 1e3, "mask_us_median": statistics.median(times) * 1e6,
                     "mask_us_max": max(times) * 1e6, "tokens_followed": followed, "tokens": len(seq)}
    return out


def workload(n: int = 64, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randint(1000, 30000) for _ in range(rng.randint(32, 256))], rng.randint(16, 256)) for _ in range(n)]


def throughput(llm, reqs, kind: str) -> dict:
    from conveyor.sampling.params import SamplingParams

    constrained = kind == "json_schema"
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True,
                             structured_outputs={"json": LONG} if constrained else None,
                             prompt_logprobs=1 if kind == "prompt_logprobs" else None) for _, m in reqs]
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
    dt = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if constrained:
        finished = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
        for c in finished:
            json.loads(c.text)   # the constrained outputs that completed parse
    return {"tok_s": tokens / dt, "tokens": tokens, "seconds": dt}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    d = tokenizer_dir()
    hf_tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    ids = hf_tok.encode(SAMPLE, add_special_tokens=False).ids
    regex_ids = hf_tok.encode("555-123-4567", add_special_tokens=False).ids
    libs = {"llguidance": bench_llguidance((d / "tokenizer.json").read_text(), ids, regex_ids),
            "outlines_core": bench_outlines(hf_tok, ids, regex_ids)}
    print(json.dumps(libs, indent=1), flush=True)

    from conveyor.engine.llm import LLM

    llm = LLM(dtype=args.dtype, max_num_seqs=64, kv_cache_gib=2, cost_model="none")
    reqs = workload()
    throughput(llm, reqs[:8], "json_schema")   # warm-up (and llguidance's tokenizer load)
    runs: dict[str, list[dict]] = {"plain": [], "json_schema": [], "prompt_logprobs": []}
    for _ in range(args.rounds):
        for kind in runs:
            runs[kind].append(throughput(llm, reqs, kind))
            print(kind, runs[kind][-1], flush=True)
    med = {k: statistics.median(r["tok_s"] for r in v) for k, v in runs.items()}
    result = {"libraries": libs, "dtype": llm.engine.dtype, "throughput": runs, "median_tok_s": med,
              "ratio": med["json_schema"] / med["plain"], "prompt_logprobs_ratio": med["prompt_logprobs"] / med["plain"]}
    lg, oc = libs["llguidance"], libs["outlines_core"]
    line = (f"JSON schema compile llguidance {lg['json']['compile_ms']:.1f} ms vs outlines-core "
            f"{oc['json']['compile_ms']:.0f} ms, mask {lg['json']['mask_us_median']:.0f} vs "
            f"{oc['json']['mask_us_median']:.0f} us/token; {llm.engine.dtype} reference workload with json_schema on "
            f"all 64 requests {med['json_schema']:.0f} vs {med['plain']:.0f} tok/s unconstrained "
            f"({result['ratio']:.2f}x); prompt_logprobs=1 on all 64 requests {med['prompt_logprobs']:.0f} tok/s "
            f"({result['prompt_logprobs_ratio']:.2f}x)")
    print(line)
    save("structured_outputs", result, line)


if __name__ == "__main__":
    main()
