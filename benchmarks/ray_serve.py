"""Ray Serve with 2 engine replicas against the built-in data-parallel server, on the same cores.

    python benchmarks/ray_serve.py [--rounds 3] [--requests 64] [--dtype bfloat16] [--setups dp2,ray2,ray2-http-proxy]

Each round starts each setup's server (`conveyor serve ...`, the setups interleaved, in a rotating
order), sends it the reference burst (64 requests, prompts of 32-256 random token ids, outputs
16-256, greedy, ignore_eos, streamed, all at once; a new prompt salt per run) and stops it:

- ``dp2``: ``--data-parallel-size 2 --router least-load`` (the baseline);
- ``ray2``: the same two replicas on Ray Serve, ``--ray`` (a local Ray started by the server, whose
  HTTP proxy talks to the ingress over gRPC: ``conveyor serve --ray`` sets
  ``RAY_SERVE_PROXY_USE_GRPC=1`` unless the environment says otherwise);
- ``ray2-http-proxy``: ``ray2`` with ``RAY_SERVE_PROXY_USE_GRPC=0`` (Serve's default proxy path).

Reported per run: output tok/s, and the CPU seconds the server's whole process tree spent during the
burst, split into the engine processes and everything else (the front end, Serve's proxy, ingress and
replica actors, Ray's own daemons), per output token: the overhead a setup adds, which on a shared,
noisy machine varies less than throughput does. Ratios are medians over the rounds against dp2.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import save  # noqa: E402

from conveyor.bench.serve import LoadConfig, ServerProcess, run_load  # noqa: E402

SETUPS = {
    "dp2": ([], {}),
    "ray2": (["--ray"], {}),
    "ray2-http-proxy": (["--ray"], {"RAY_SERVE_PROXY_USE_GRPC": "0"}),
}
ENGINE_MARK = "spawn_main"   # the engine processes (multiprocessing spawn children) in the server's tree


def server_args(setup: str, dtype: str) -> list[str]:
    return [*SETUPS[setup][0], "--data-parallel-size", "2", "--router", "least-load", "--dtype", dtype,
            "--max-num-seqs", "64", "--kv-cache-gib", "2", "--log-interval", "0",
            "--served-model-name", "SmolLM2-135M-Instruct", "--cost-model", "none"]


def processes() -> dict[int, tuple[str, float, int]]:
    """pid -> (command line, CPU seconds so far, parent pid), for every process visible in /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out[int(pid)] = (cmd, (int(fields[11]) + int(fields[12])) / tick, int(fields[1]))
    return out


def tree_cpu(root: int, before: dict, after: dict) -> dict[str, float]:
    """CPU seconds spent between the snapshots by `root`'s descendants: engines vs the rest."""
    def under(pid: int) -> bool:
        while pid > 1:
            if pid == root:
                return True
            pid = after.get(pid, ("", 0.0, 0))[2]
        return False

    split = {"engines": 0.0, "overhead": 0.0}
    for pid, (cmd, cpu, _) in after.items():
        if under(pid):
            spent = cpu - before.get(pid, (cmd, 0.0, 0))[1]
            split["engines" if ENGINE_MARK in cmd else "overhead"] += spent
    return split


@contextmanager
def environment(env: dict[str, str]):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def burst(setup: str, dtype: str, requests: int, salt: int) -> dict:
    with environment(SETUPS[setup][1]):   # ServerProcess hands the server a copy of this environment
        srv = ServerProcess(server_args(setup, dtype), startup_timeout=600)
    with srv:
        load = LoadConfig(srv.url + "/v1", num_requests=requests, prompt_salt=salt, warmup=1)
        before, t0 = processes(), time.perf_counter()
        m = asyncio.run(run_load(load))
        cpu = tree_cpu(srv.proc.pid, before, processes())
        wall = time.perf_counter() - t0
    tokens = m["total_output_tokens"] or 1
    return {"output_throughput": m["output_throughput"], "errors": m["errors"], "duration_s": m["duration_s"],
            "wall_s": wall, "cpu_s": cpu, "overhead_cpu_ms_per_token": 1000 * cpu["overhead"] / tokens,
            "ttft_p50_s": m["ttft_s"].get("median"), "tpot_p50_s": m["tpot_s"].get("median")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"from {', '.join(SETUPS)}; dp2 is the baseline")
    ap.add_argument("--name", default="ray_serve", help="results/NAME.json")
    args = ap.parse_args()
    setups = args.setups.split(",")
    if "dp2" not in setups or any(s not in SETUPS for s in setups):
        raise SystemExit(f"--setups: dp2 (the baseline) and any of {', '.join(SETUPS)}")
    runs: dict[str, list[dict]] = {s: [] for s in setups}
    for r in range(args.rounds):
        order = setups[r % len(setups):] + setups[:r % len(setups)]   # who goes first rotates
        for setup in order:
            res = burst(setup, args.dtype, args.requests, salt=100 * r + setups.index(setup))
            print(args.dtype, setup, r, {k: res[k] for k in ("output_throughput", "overhead_cpu_ms_per_token",
                                                             "errors")}, flush=True)
            runs[setup].append(res)
    tok = {s: statistics.median(x["output_throughput"] for x in v) for s, v in runs.items()}
    ovh = {s: statistics.median(x["overhead_cpu_ms_per_token"] for x in v) for s, v in runs.items()}
    result = {"dtype": args.dtype, "requests": args.requests, "rounds": args.rounds, "cores": os.cpu_count(),
              "runs": runs, "median_output_throughput": tok, "median_overhead_cpu_ms_per_token": ovh,
              "ratio_to_dp2": {s: tok[s] / tok["dp2"] for s in tok}}
    line = f"{args.dtype}, {args.requests} requests x {args.rounds} rounds: DP2 {tok['dp2']:.0f} tok/s" + "".join(
        f", {s} {tok[s]:.0f} ({tok[s] / tok['dp2']:.2f}x)" for s in setups if s != "dp2") + \
        "; overhead CPU ms/token " + ", ".join(f"{s} {ovh[s]:.2f}" for s in setups)
    print(line)
    save(args.name, result, line)


if __name__ == "__main__":
    main()
