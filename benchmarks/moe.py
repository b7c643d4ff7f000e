"""A mixture-of-experts GGUF on this CPU: Conveyor and llama.cpp on the same file, interleaved.

    python benchmarks/moe.py [--size moe-16l] [--qtype Q4_K_M] [--rounds 2] [--tokens 64] [--streams 8 32]

The file is a synthetic "qwen3moe" GGUF (`conveyor.bench.synthetic_gguf.write_moe`: Qwen3-30B-A3B's
layers, 128 experts of 768, top-8, random weights), written once under benchmarks/results/synthetic.
Each round runs, in alternating order:

- **Conveyor** in a fresh process at its defaults (dtype auto, weights as stored, prefix caching
  off so that repeated prompts are computed): load time; batch-1 decode (a 1-token prompt and
  `--tokens` greedy tokens, median of 3 after a warm-up) against the weight-read floor of the
  *active* parameters (attention, router, the k experts' share of each MoE layer, the LM head) over
  the memory bandwidth measured in the same process (a 1 GiB sum); batched throughput with N
  streams (N distinct 16-token prompts, `--tokens` each, submitted at once: generated tokens over
  the wall time, prefill included; the distinct experts a layer ran in the last step, all N
  decoding); decode steps of N sequences of random tokens (as llama-batched-bench's, whose S_TG
  they compare with; a random model's greedy streams repeat one token and all route alike); peak RSS (before the bandwidth probe). Its KV cache holds what
  llama.cpp's context does (every stream's prompt and output), no swap pool.
- **llama.cpp** (benchmarks/peers/setup_llamacpp.sh): `llama-bench -p 0 -n TOKENS` over threads
  1..cores (the best is kept), and `llama-batched-bench -npp 16 -ntg TOKENS -npl N` at ubatch 512
  and 2048 (the best is kept; its generated tokens over its total time, and its decode speed S_TG,
  which it measures on random tokens); peak RSS of each process.

Writes benchmarks/results/moe_<size>_<qtype>.json and a line in docs/benchmarks.md with the CPU
model and flags. `--no-llamacpp` measures Conveyor alone.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
LLAMA = HERE / "peers" / ".llamacpp" / "bin"
PROMPT = 16


def active_bytes(model) -> dict:
    """Bytes one decode token reads: every dense or quantized matrix outside the experts, the
    routers, and top_k / experts of each MoE layer's expert bytes (a random expert's share)."""
    from conveyor.model.llama import SparseMoE
    from conveyor.model.quant import QuantLinear

    def nbytes(m) -> int:
        if isinstance(m, QuantLinear):
            return m.qweight.numel()
        w = getattr(m, "weight", None)
        return 0 if w is None else w.numel() * w.element_size()

    experts = other = active = 0
    expert_ids = set()
    for layer in model.layers:
        if isinstance(layer.mlp, SparseMoE):
            moe = layer.mlp
            layer_experts = sum(nbytes(e.gate_up_proj) + nbytes(e.down_proj) for e in moe.experts)
            expert_ids |= {id(m) for e in moe.experts for m in (e.gate_up_proj, e.down_proj)}
            experts += layer_experts
            active += layer_experts * moe.top_k // moe.num_experts
    for m in model.modules():
        if id(m) not in expert_ids and (isinstance(m, QuantLinear) or type(m).__name__ in ("Linear", "CpuLinear")):
            other += nbytes(m)
    head = model.cpu_lm_head
    if head is not None and not any(head is m for m in model.modules()):
        other += nbytes(head)
    return {"experts": experts, "other": other, "active": active + other}


def conveyor_worker(model: str, tokens: int, streams: list[int]) -> dict:
    import torch

    from conveyor import LLM, SamplingParams
    from decode_b1 import bandwidth

    t = time.perf_counter()
    # The KV cache llama.cpp gets (-c: every stream's prompt and output), no swap pool.
    blocks = -(-max(streams) * (PROMPT + tokens + 16) // 16) + 1
    llm = LLM(model, max_num_seqs=max(streams), enable_prefix_caching=False, cost_model="none", block_size=16,
              num_kv_blocks=blocks, swap_space_gib=0)
    load_s = time.perf_counter() - t
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    one = [{"prompt_token_ids": [engine.tokenizer.bos_token_id or 1]}]
    llm.generate(one, params, use_tqdm=False)   # warm-up
    times = []
    for _ in range(3):
        t = time.perf_counter()
        out = llm.generate(one, params, use_tqdm=False)
        times.append(time.perf_counter() - t)
        assert len(out[0].outputs[0].token_ids) == tokens
    b1 = tokens / statistics.median(times)
    batched, experts = {}, {}
    vocab = engine.model_config.vocab_size
    for n in streams:
        prompts = [{"prompt_token_ids": [(37 * i + 101 * j) % (vocab - 1) + 1 for j in range(PROMPT)]} for i in range(n)]
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
        batched[n] = n * tokens / wall
        moes = [layer.mlp for layer in engine.runner.model.layers if hasattr(layer.mlp, "last_experts")]
        experts[n] = statistics.mean(m.last_experts for m in moes)   # the last step's (all n decoding)
    # Decode steps of N sequences of random tokens (as llama-batched-bench feeds them: a random model's
    # greedy outputs repeat one token, which sends every stream to the same experts), 64 tokens of
    # context each: N over the median step time.
    from conveyor.profile import _Plans

    plans = _Plans(engine, seed=1)
    decode = {}
    for n in streams:
        steps = []
        for _ in range(8):
            plan = plans.plan([plans.seq(PROMPT + tokens // 2, 1) for _ in range(n)])
            t = time.perf_counter()
            engine.runner.execute(plan)
            steps.append(time.perf_counter() - t)
        moes = [layer.mlp for layer in engine.runner.model.layers if hasattr(layer.mlp, "last_experts")]
        decode[n] = {"tok_s": n / statistics.median(steps[2:]),
                     "distinct_experts_per_layer": statistics.mean(m.last_experts for m in moes)}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # before the bandwidth probe's 1 GiB
    x = torch.ones((1 << 30) // 4)
    bw = statistics.median(bandwidth(x) for _ in range(3))
    del x
    act = active_bytes(engine.runner.model)
    return {"load_s": load_s, "dtype": engine.dtype, "b1_tok_s": b1, "bandwidth_gb_s": bw / 1e9,
            "active_bytes": act, "floor_tok_s": bw / act["active"], "b1_vs_floor": (bw / act["active"]) / b1,
            "batched_tok_s": batched, "distinct_experts_per_layer": experts, "decode_random": decode,
            "peak_rss_mib": rss,
            "weights": engine.loaded.model.weight_bytes_summary()}


def _child(cmd: list[str]) -> tuple[str, float]:
    """A child process's stdout and its peak RSS (MiB); raises if it fails."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = proc.stdout.read()
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status:
        raise RuntimeError(f"{cmd[0]} failed ({status}): {err[-2000:]}")
    return out, usage.ru_maxrss / 1024


def run_conveyor(model: str, tokens: int, streams: list[int]) -> dict:
    out, _ = _child([sys.executable, __file__, "--worker", "--model", model, "--tokens", str(tokens),
                     "--streams", *map(str, streams)])
    return json.loads(out.strip().splitlines()[-1])


def run_llamacpp(model: str, tokens: int, streams: list[int]) -> dict:
    """llama.cpp at its best threads (batch 1) and ubatch (batched) on this machine."""
    cores = os.cpu_count() or 1
    best_b1, rss = None, 0.0
    for threads in range(1, cores + 1):
        out, peak = _child([str(LLAMA / "llama-bench"), "-m", model, "-p", "0", "-n", str(tokens), "-t", str(threads),
                            "-o", "json"])
        (row,) = json.loads(out)
        rss = max(rss, peak)
        if best_b1 is None or row["avg_ts"] > best_b1["tok_s"]:
            best_b1 = {"tok_s": row["avg_ts"], "threads": threads, "build": row.get("build_commit")}
    batched, settings, decode = {}, {}, {}
    ctx = max(streams) * (PROMPT + tokens) + 64
    for ubatch in (512, 2048):
        out, peak = _child([str(LLAMA / "llama-batched-bench"), "-m", model, "-c", str(ctx), "-b", "2048",
                            "-ub", str(ubatch), "-npp", str(PROMPT), "-ntg", str(tokens), "-npl",
                            ",".join(map(str, streams)), "-t", str(cores), "--output-format", "jsonl"])
        rss = max(rss, peak)
        for line in out.splitlines():
            if line.startswith("{") and '"pl"' in line:
                row = json.loads(line)
                n = int(row["pl"])
                speed = n * int(row["tg"]) / float(row["t"])
                if speed > batched.get(str(n), 0):   # (string keys, as in the workers' JSON)
                    batched[str(n)], settings[str(n)] = speed, {"ubatch": ubatch, "threads": cores}
                    decode[str(n)] = float(row["speed_tg"])
    return {"b1_tok_s": best_b1["tok_s"], "b1_threads": best_b1["threads"], "build": best_b1["build"],
            "batched_tok_s": batched, "decode_tok_s": decode, "batched_settings": settings, "peak_rss_mib": rss}


def main() -> None:
    from conveyor.bench.synthetic_gguf import MOE_SIZES, write_moe

    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=sorted(MOE_SIZES), default="moe-16l")
    ap.add_argument("--qtype", default="Q4_K_M")
    ap.add_argument("--model", default=None, help="a GGUF file instead of the synthetic one")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(conveyor_worker(args.model, args.tokens, args.streams)))
        return
    if args.model is None:
        from conveyor.model.loader import demo_model_path

        out = ROOT / "benchmarks" / "results" / "synthetic"
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"synthetic-qwen3moe-{args.size}-{args.qtype}.gguf"
        if not path.exists():
            t = time.perf_counter()
            write_moe(args.size, args.qtype, out, demo_model_path())
            print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t:.0f} s", flush=True)
        args.model = str(path)
    peer = not args.no_llamacpp
    if peer and not (LLAMA / "llama-bench").exists():
        sys.exit(f"{LLAMA} missing: run benchmarks/peers/setup_llamacpp.sh first (or pass --no-llamacpp)")
    runs: dict[str, list[dict]] = {"conveyor": [], **({"llama.cpp": []} if peer else {})}
    for r in range(args.rounds):
        for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
            res = run_conveyor(args.model, args.tokens, args.streams) if name == "conveyor" else \
                run_llamacpp(args.model, args.tokens, args.streams)
            runs[name].append(res)
            print(r, name, json.dumps(res), flush=True)
    from common import save

    def med(name: str, key: str, n: int | None = None) -> float:
        return statistics.median(x[key] if n is None else x[key][str(n)] for x in runs[name])

    c = runs["conveyor"]
    result = {"model": args.model, "file_gb": Path(args.model).stat().st_size / 1e9, "tokens": args.tokens,
              "streams": args.streams, "rounds": args.rounds, "runs": runs,
              "conveyor": {"b1_tok_s": med("conveyor", "b1_tok_s"), "b1_vs_floor": med("conveyor", "b1_vs_floor"),
                           "batched_tok_s": {n: med("conveyor", "batched_tok_s", n) for n in args.streams},
                           "decode_random_tok_s": {n: statistics.median(x["decode_random"][str(n)]["tok_s"] for x in c)
                                                   for n in args.streams},
                           "peak_rss_mib": max(x["peak_rss_mib"] for x in c),
                           "load_s": [x["load_s"] for x in c]}}
    line = (f"MoE {Path(args.model).name} ({result['file_gb']:.1f} GB), {c[0]['dtype']}: batch-1 "
            f"{result['conveyor']['b1_tok_s']:.1f} tok/s, {result['conveyor']['b1_vs_floor']:.2f}x the active-bytes floor; "
            + ", ".join(f"{n} streams {v:.1f} tok/s" for n, v in result["conveyor"]["batched_tok_s"].items())
            + "; decode steps of random tokens "
            + ", ".join(f"{n} streams {v:.1f} tok/s" for n, v in result["conveyor"]["decode_random_tok_s"].items())
            + f"; peak RSS {result['conveyor']['peak_rss_mib']:.0f} MiB")
    if peer:
        lb1 = med("llama.cpp", "b1_tok_s")
        lbatch = {n: med("llama.cpp", "batched_tok_s", n) for n in args.streams}
        lrss = max(x["peak_rss_mib"] for x in runs["llama.cpp"])
        ldec = {n: med("llama.cpp", "decode_tok_s", n) for n in args.streams}
        result["llama.cpp"] = {"b1_tok_s": lb1, "batched_tok_s": lbatch, "decode_tok_s": ldec, "peak_rss_mib": lrss}
        cv = result["conveyor"]
        result["ratios"] = {"b1": cv["b1_tok_s"] / lb1,
                            **{f"streams_{n}": cv["batched_tok_s"][n] / lbatch[n] for n in args.streams},
                            **{f"decode_{n}": cv["decode_random_tok_s"][n] / ldec[n] for n in args.streams},
                            "peak_rss": cv["peak_rss_mib"] / lrss}
        line += (f"; llama.cpp batch-1 {lb1:.1f} ({result['ratios']['b1']:.2f}x), "
                 + ", ".join(f"{n} streams {lbatch[n]:.1f} ({result['ratios'][f'streams_{n}']:.2f}x)" for n in args.streams)
                 + ", its decode (S_TG) " + ", ".join(f"{n} streams {ldec[n]:.1f} ({result['ratios'][f'decode_{n}']:.2f}x)"
                                                     for n in args.streams)
                 + f", peak RSS {lrss:.0f} MiB")
    save(f"moe_{args.size}_{args.qtype}", result, line + f" (medians of {args.rounds} interleaved rounds)")


if __name__ == "__main__":
    main()
