"""Conveyor and llama.cpp on the same GGUF file, single stream, in one run.

Build llama.cpp once with `benchmarks/peers/setup_llamacpp.sh` (~10 minutes). Then:

    python benchmarks/peers/llamacpp.py [--rounds 3] [--model FILE.gguf] [--tokens 128]

- llama.cpp: `llama-bench -p 0 -n 128 -t <cores>` (its tg128: 128 tokens generated after an
  empty prompt, the mean over its own repetitions).
- Conveyor: one request of a 1-token prompt and 128 greedy tokens (ignore_eos) through
  `LLM.generate` in a fresh process per configuration, the median of 3 repetitions after a
  warm-up: the weights as stored (`--quantization auto`) in fp32, and
  the dequantized fp32 model (`--quantization none`) for the ratio llama.cpp's Q4-vs-F32 is; and bf16
  on both quantized kernels (`CONVEYOR_QUANT_BF16=int8` and `=bf16`; the CPU's flags choose one by default).
Rounds alternate the order of the engines. Writes benchmarks/results/llamacpp.json and a line
in docs/benchmarks.md, with the CPU model and flags (llamacpp_<file stem>.json for other files).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import save  # noqa: E402

BENCH = HERE / ".llamacpp" / "bin" / "llama-bench"
OUR_PY = ROOT / ".venv" / "bin" / "python"
# name -> (dtype, quantization, CONVEYOR_QUANT_BF16 or None). bf16 runs on both quantized kernels: the
# int8 one (int8 activations) and the bf16-rounding one; the CPU's flags choose one by default.
CONFIGS = {"conveyor as stored, fp32": ("float32", "auto", None),
           "conveyor as stored, bf16 int8 kernel": ("bfloat16", "auto", "int8"),
           "conveyor as stored, bf16 kernel": ("bfloat16", "auto", "bf16"),
           "conveyor dequantized, fp32": ("float32", "none", None)}


def conveyor_worker(model: str, dtype: str, quantization: str, tokens: int) -> dict:
    from conveyor import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, quantization=quantization, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompt = {"prompt_token_ids": [llm.engine.tokenizer.bos_token_id or 1]}
    llm.generate([prompt], params, use_tqdm=False)   # warm-up
    times = []
    for _ in range(3):
        t = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)
        times.append(time.perf_counter() - t)
        assert len(out[0].outputs[0].token_ids) == tokens
    return {"tok_s": tokens / statistics.median(times), "dtype": llm.engine.dtype,
            "weights": llm.engine.loaded.model.weight_bytes_summary()}


def run_conveyor(model: str, dtype: str, quantization: str, bf16_kernel: str | None, tokens: int) -> dict:
    env = {**os.environ, **({"CONVEYOR_QUANT_BF16": bf16_kernel} if bf16_kernel else {})}
    out = subprocess.run([str(OUR_PY), __file__, "--worker", dtype, quantization, "--model", model,
                          "--tokens", str(tokens)], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_llamacpp(model: str, tokens: int, threads: int) -> dict:
    out = subprocess.run([str(BENCH), "-m", model, "-p", "0", "-n", str(tokens), "-t", str(threads), "-o", "json"],
                         capture_output=True, text=True, check=True)
    (row,) = json.loads(out.stdout)
    return {"tok_s": row["avg_ts"], "build": row.get("build_commit"), "cpu": row.get("cpu_info"),
            "type": row.get("model_type")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a GGUF file (default: the demo model)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--name", default=None, help="results name (default: llamacpp[_MODEL]); one per machine kind")
    ap.add_argument("--worker", nargs=2, metavar=("DTYPE", "QUANTIZATION"))
    args = ap.parse_args()
    if args.model is None:
        from conveyor.model.loader import demo_model_path

        args.model = str(demo_model_path())
    if args.worker:
        print(json.dumps(conveyor_worker(args.model, *args.worker, args.tokens)))
        return
    if not BENCH.exists():
        sys.exit(f"{BENCH} missing: run benchmarks/peers/setup_llamacpp.sh first")
    threads = os.cpu_count() or 1
    runs: dict[str, list[dict]] = {"llama.cpp": [], **{name: [] for name in CONFIGS}}
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            res = run_llamacpp(args.model, args.tokens, threads) if name == "llama.cpp" else \
                run_conveyor(args.model, *CONFIGS[name], args.tokens)
            runs[name].append(res)
            print(r, name, res, flush=True)
    from conveyor.profile import machine

    med = {name: statistics.median(x["tok_s"] for x in rs) for name, rs in runs.items()}
    result = {"model": args.model, "tokens": args.tokens, "threads": threads, "rounds": args.rounds,
              "tok_s": med, "runs": runs, "machine": machine()}
    base = med["llama.cpp"]
    line = (f"single stream on {Path(args.model).name}, {result['machine']['cpu_family']}, {threads} threads "
            f"(medians of {args.rounds} interleaved rounds): llama.cpp tg{args.tokens} {base:.1f} tok/s; " +
            ", ".join(f"{n} {v:.1f} ({v / base:.2f}x)" for n, v in med.items() if n != "llama.cpp"))
    from conveyor.model.loader import demo_model_path

    save(args.name or ("llamacpp" if Path(args.model) == demo_model_path() else f"llamacpp_{Path(args.model).stem}"),
         result, line)


if __name__ == "__main__":
    main()
