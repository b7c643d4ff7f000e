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
3. The simulator's prediction of the same burst for each setup (`--skip-predict` leaves it out):
   `conveyor profile` at each replica's thread count (all cores for one replica, half for two), then
   `conveyor simulate --trace` of the load client's exact lengths with the same knobs and router.
   The profile of a half-machine replica is measured twice: alone on the machine, and with a
   twin profile running at the same time on the other cores (what a replica sees beside its
   neighbour: shared memory bandwidth and last-level cache). Then the same, corrected by the step
   trace of round 1's single-replica burst (`conveyor simulate --validate TRACE --calibrate`): its
   own profile for DP1, and its factors carried over to the half-machine profile for DP2 — the
   front end's share of the cores, which no profile of the engine alone sees. Ray Serve's
   replicas are priced as the built-in server's (the simulator does not model Serve's extra hop).
4. `conveyor simulate` on H200 roofline models: Llama-3.1-8B TP=1 x 2 replicas vs TP=2 x 1, and
   Llama-3.1-70B TP=4 x 2 vs TP=8 x 1 (same GPU count), at a fixed request rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

from common import machine, save  # noqa: E402

from conveyor.bench.serve import LoadConfig, ServerProcess, make_workload, run_load  # noqa: E402

CORES = os.cpu_count() or 1
SETUPS = {
    "dp1": ["--data-parallel-size", "1"],
    "dp2": ["--data-parallel-size", "2", "--router", "least-load"],
    "tp2": ["--tensor-parallel-size", "2"],
    # Ray Serve: the same 2 replicas, placed and routed by Ray (conveyor/ray/serve.py; needs conveyor[ray])
    "ray2": ["--ray", "--data-parallel-size", "2", "--router", "least-load"],
}
ONLINE_RATES = {"bfloat16": (2.0, 8.0), "float32": (1.0, 4.0)}


def engine_knobs(dtype: str) -> list[str]:
    """What the servers and the simulator are both given."""
    return ["--dtype", dtype, "--max-num-seqs", "64", "--kv-cache-gib", "2"]


def server_args(setup: str, dtype: str) -> list[str]:
    return [*SETUPS[setup], *engine_knobs(dtype), "--log-interval", "0",
            "--served-model-name", "SmolLM2-135M-Instruct", "--cost-model", "none"]


def burst(setup: str, dtype: str, salt: int, step_trace: Path | None = None) -> dict:
    trace = ["--step-trace", str(step_trace)] if step_trace else []
    with ServerProcess(server_args(setup, dtype) + trace) as srv:
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


def burst_trace(path: Path) -> Path:
    """The burst's requests as a simulator trace: the load client's own lengths (seed 0, all at once)."""
    specs = make_workload(64, (32, 256), (16, 256), math.inf, 0)
    path.write_text("".join(json.dumps({"arrival": 0.0, "prompt_len": s.prompt_len, "output_len": s.output_len}) + "\n"
                            for s in specs))
    return path


def measure_profiles(dtype: str, threads: int, copies: int, out: Path) -> list[Path]:
    """`copies` profiles at `threads` threads each, measured at the same time (1: alone)."""
    paths = [out / f"profile-{dtype}-t{threads}-x{copies}-{i}.json" for i in range(copies)]
    procs = [subprocess.Popen([sys.executable, "-m", "conveyor", "profile", "--dtype", dtype, "--torch-threads",
                               str(threads), "--out", str(p)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True) for p in paths]
    for proc in procs:
        _, err = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"conveyor profile failed: {err[-2000:]}")
    return paths


def simulate_burst(profile_path: Path, replicas: int, dtype: str, trace: Path, out: Path) -> dict:
    path = out / f"sim-{profile_path.stem}-dp{replicas}.json"
    cmd = [sys.executable, "-m", "conveyor", "simulate", "--cost-model", str(profile_path), "--trace", str(trace),
           "--replicas", str(replicas), "--router", "least-load", *engine_knobs(dtype), "--out", str(path)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    s = json.loads(path.read_text())["runs"][0]["summary"]
    return {k: s[k] for k in ("output_tok_s", "p50_ttft_s", "p50_tpot_s") if k in s}


def calibrated(profile_path: Path, step_trace: Path):
    """The profile corrected by the real server's step trace (`conveyor simulate --validate TRACE
    --calibrate`: a factor per knot and the gap between steps, fitted on alternate runs of steps),
    and the fit's report."""
    from conveyor.core.trace import StepTracer
    from conveyor.sim.cost import StepCostModel
    from conveyor.sim.validate import calibrate

    corrected, report = calibrate(StepTracer.load(step_trace), StepCostModel.load(profile_path))
    return corrected, {"between_steps_ms": report["between_steps_ms"],
                       "held_out_step_error": {k: report[k]["all"]["error"] for k in ("before", "after")}}


def with_correction(profile_path: Path, corrected, name: str) -> Path:
    """The profile at `profile_path` given `corrected`'s correction (same knots: the same model), saved as `name`."""
    from conveyor.sim.cost import StepCostModel

    target = StepCostModel.load(profile_path)
    if list(target.knots) != list(corrected.knots):
        raise ValueError(f"{profile_path} has other knots than the corrected profile: "
                         "the correction does not carry over")
    path = profile_path.with_name(name)
    replace(target, decode_scales=corrected.decode_scales, prefill_scales=corrected.prefill_scales,
            between_steps=corrected.between_steps).save(path)
    return path


def predict(dtype: str, setups: list[str], out: Path, step_trace: Path | None) -> dict:
    """The simulator's burst prediction per setup, from profiles at each replica's thread count, and
    (with `step_trace`, one real burst of the single-replica server) corrected by that trace."""
    trace = burst_trace(out / "burst.jsonl")
    pred: dict = {}
    one = measure_profiles(dtype, CORES, 1, out)[0]
    half = max(1, CORES // 2)
    alone = measure_profiles(dtype, half, 1, out)[0]
    beside = measure_profiles(dtype, half, CORES // half, out)[0]
    if step_trace is not None:
        corrected, fit = calibrated(one, step_trace)
        one_corrected = with_correction(one, corrected, f"{one.stem}-corrected.json")
        beside_corrected = with_correction(beside, corrected, f"{beside.stem}-corrected-like-{one.stem}.json")
        pred["calibration"] = fit
        print("correction from the DP1 server's step trace:", fit, flush=True)
    for setup in setups:
        if setup == "dp1":
            pred[setup] = {"profile": simulate_burst(one, 1, dtype, trace, out)}
            if step_trace is not None:
                pred[setup]["corrected"] = simulate_burst(one_corrected, 1, dtype, trace, out)
        elif setup in ("dp2", "ray2"):
            pred[setup] = {"profile alone": simulate_burst(alone, 2, dtype, trace, out),
                           "profile beside a twin": simulate_burst(beside, 2, dtype, trace, out)}
            if step_trace is not None:
                pred[setup]["beside a twin, DP1's correction"] = simulate_burst(beside_corrected, 2, dtype, trace,
                                                                                out)
    return pred


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-online", action="store_true")
    ap.add_argument("--skip-burst", action="store_true")
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"burst setups, from {', '.join(SETUPS)}")
    ap.add_argument("--skip-predict", action="store_true", help="no simulator prediction of the burst setups")
    ap.add_argument("--skip-sim", action="store_true", help="no H200 simulations")
    ap.add_argument("--name", default="scale_out", help="results/NAME.json (another name keeps the last full run)")
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="scale-out-"))
    result: dict = {"cores": CORES, "machine": machine(), "burst": {}, "predicted": {}, "online": {},
                    "simulated_h200": {}}
    lines = []
    for dtype in args.dtypes.split(","):
        if args.skip_burst:
            break
        setups = args.setups.split(",")
        runs: dict[str, list[float]] = {s: [] for s in setups}
        step_trace = None if args.skip_predict or "dp1" not in setups else out / f"trace-dp1-{dtype}.json"
        for r in range(args.rounds):
            for setup in setups:
                res = burst(setup, dtype, salt=100 * r + len(runs[setup]),
                            step_trace=step_trace if (setup, r) == ("dp1", 0) else None)
                print(dtype, setup, r, res, flush=True)
                runs[setup].append(res["output_throughput"])
        med = {s: statistics.median(v) for s, v in runs.items()}
        result["burst"][dtype] = {"runs": runs, "median": med,
                                  "ratio_to_dp1": {s: med[s] / med["dp1"] for s in med}}
        lines.append(f"{dtype} burst tok/s DP1 {med['dp1']:.0f}" + "".join(
            f", {s.upper()} {med[s]:.0f} ({med[s] / med['dp1']:.2f}x)" for s in setups if s != "dp1"))
        if not args.skip_predict:
            pred = result["predicted"][dtype] = predict(dtype, setups, out, step_trace)
            for setup, by in pred.items():
                if setup == "calibration":
                    continue
                for how, p in by.items():
                    p["error_vs_median"] = p["output_tok_s"] / med[setup] - 1
                    print(dtype, setup, how, p, flush=True)
            lines.append(f"{dtype} simulated vs measured tok/s " + ", ".join(
                f"{s.upper()} " + "/".join(f"{100 * p['error_vs_median']:+.0f}%" for p in by.values())
                for s, by in pred.items() if s != "calibration"))
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
