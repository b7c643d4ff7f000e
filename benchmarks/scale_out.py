"""Scale-out on this machine: data-parallel replicas vs one engine vs tensor parallelism, and the
simulator's prediction for the same choice on GPUs.

    python benchmarks/scale_out.py [--dtypes bfloat16,float32] [--rounds 2] [--skip-online]

1. Burst (the reference workload: 64 requests, prompts of 32-256 random token ids, outputs 16-256,
   greedy, ignore_eos, all sent at once over HTTP to `conveyor serve`): output tok/s of
   - 1 replica x all threads (`--data-parallel-size 1`),
   - 2 replicas x half the threads each (`--data-parallel-size 2 --router least-load`),
   - tensor parallel over 2 ranks x half the threads (`--tensor-parallel-size 2`, gloo),
   - 2 replicas on Ray Serve (`--ray --data-parallel-size 2 --router least-load`),
   interleaved, `--rounds` times (`--setups` picks some); medians and ratios to the 1-replica run.
2. Online with vLLM's own load client (`vllm bench serve`, random 128/128, 100 prompts, from
   benchmarks/peers) at one rate below and one above saturation: DP=1 vs DP=2 TTFT/TPOT.
   Needs the vLLM venv of benchmarks/peers/setup_vllm.sh; skipped with --skip-online.
3. `conveyor simulate` on H200 roofline models: Llama-3.1-8B TP=1 x 2 replicas vs TP=2 x 1, and
   Llama-3.1-70B TP=4 x 2 vs TP=8 x 1 (same GPU count), at a fixed request rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

from common import save  # noqa: E402

from conveyor.bench.serve import LoadConfig, ServerProcess, run_load  # noqa: E402

CORES = os.cpu_count() or 1
SETUPS = {
    "dp1": ["--data-parallel-size", "1"],
    "dp2": ["--data-parallel-size", "2", "--router", "least-load"],
    "tp2": ["--tensor-parallel-size", "2"],
    # Ray Serve: the same 2 replicas, placed and routed by Ray (conveyor/ray/serve.py; needs conveyor[ray])
    "ray2": ["--ray", "--data-parallel-size", "2", "--router", "least-load"],
}
ONLINE_RATES = {"bfloat16": (2.0, 8.0), "float32": (1.0, 4.0)}


def server_args(setup: str, dtype: str) -> list[str]:
    return [*SETUPS[setup], "--dtype", dtype, "--max-num-seqs", "64", "--kv-cache-gib", "2", "--log-interval", "0",
            "--served-model-name", "SmolLM2-135M-Instruct", "--cost-model", "none"]


def burst(setup: str, dtype: str, salt: int) -> dict:
    with ServerProcess(server_args(setup, dtype)) as srv:
        m = asyncio.run(run_load(LoadConfig(srv.url + "/v1", num_requests=64, prompt_salt=salt, warmup=1)))
    return {"output_throughput": m["output_throughput"], "errors": m["errors"], "duration_s": m["duration_s"]}


def online(setup: str, dtype: str, model_dir: Path, out: Path) -> dict:
    from compare import bench_serve

    res = {}
    with ServerProcess(server_args(setup, dtype)) as srv:
        for rate in ONLINE_RATES[dtype]:
            res[str(rate)] = bench_serve(model_dir, srv.port, rate, 100, out, f"{setup}-{dtype}-{rate}")
    return res


def simulate(model: str, tp: int, replicas: int, rate: float, out: Path) -> dict:
    path = out / f"sim-{model}-tp{tp}-dp{replicas}.json"
    cmd = [sys.executable, "-m", "conveyor", "simulate", "--gpu", "h200", "--model", model, "--tensor-parallel",
           str(tp), "--replicas", str(replicas), "--rate", str(rate), "--num-requests", "2000",
           "--prompt-len", "lognormal:1000:1:8000", "--output-len", "lognormal:300:1:2000",
           "--max-num-seqs", "256", "--max-num-batched-tokens", "8192", "--out", str(path)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    s = json.loads(path.read_text())["runs"][0]["summary"]
    keys = ("output_tok_s", "req_s", "p50_ttft_s", "p99_ttft_s", "p50_tpot_s", "p99_tpot_s", "num_preemptions")
    return {k: s[k] for k in keys if k in s} | {"gpus": tp * replicas}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-online", action="store_true")
    ap.add_argument("--skip-burst", action="store_true")
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"burst setups, from {', '.join(SETUPS)}")
    ap.add_argument("--skip-sim", action="store_true")
    ap.add_argument("--name", default="scale_out", help="results/NAME.json (another name keeps the last full run)")
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="scale-out-"))
    result: dict = {"cores": CORES, "burst": {}, "online": {}, "simulated_h200": {}}
    lines = []
    for dtype in args.dtypes.split(","):
        if args.skip_burst:
            break
        setups = args.setups.split(",")
        runs: dict[str, list[float]] = {s: [] for s in setups}
        for r in range(args.rounds):
            for setup in setups:
                res = burst(setup, dtype, salt=100 * r + len(runs[setup]))
                print(dtype, setup, r, res, flush=True)
                runs[setup].append(res["output_throughput"])
        med = {s: statistics.median(v) for s, v in runs.items()}
        result["burst"][dtype] = {"runs": runs, "median": med,
                                  "ratio_to_dp1": {s: med[s] / med["dp1"] for s in med}}
        lines.append(f"{dtype} burst tok/s DP1 {med['dp1']:.0f}" + "".join(
            f", {s.upper()} {med[s]:.0f} ({med[s] / med['dp1']:.2f}x)" for s in setups if s != "dp1"))
    if not args.skip_online:
        from compare import model_dir

        mdir = model_dir()
        dtype = args.dtypes.split(",")[0]
        result["online"][dtype] = {s: online(s, dtype, mdir, out) for s in ("dp1", "dp2")}
        for rate in ONLINE_RATES[dtype]:
            a, b = result["online"][dtype]["dp1"][str(rate)], result["online"][dtype]["dp2"][str(rate)]
            lines.append(f"{dtype} vllm bench serve {rate} req/s TTFT p99 {a['p99_ttft_ms']:.0f} -> "
                         f"{b['p99_ttft_ms']:.0f} ms, TPOT p50 {a['median_tpot_ms']:.1f} -> "
                         f"{b['median_tpot_ms']:.1f} ms (DP1 -> DP2)")
            print(lines[-1], flush=True)
    sims = {"llama-3.1-8b": (((1, 2), (2, 1)), 30.0), "llama-3.1-70b": (((4, 2), (8, 1)), 10.0)}
    for model, (shapes, rate) in sims.items() if not args.skip_sim else ():
        for tp, dp in shapes:
            key = f"{model} tp{tp} x dp{dp} @ {rate}/s"
            result["simulated_h200"][key] = simulate(model, tp, dp, rate, out)
            print(key, result["simulated_h200"][key], flush=True)
    sim = result["simulated_h200"]
    if sim:
        lines.append("H200 sim TPOT p50 " + ", ".join(f"{k.split(' @')[0]} {v['p50_tpot_s'] * 1e3:.1f} ms"
                                                       for k, v in sim.items()))
    print(json.dumps(result, indent=1))
    save(args.name, result, "; ".join(lines))


if __name__ == "__main__":
    main()
