"""Conveyor's server and llama-server on the same GGUF file, under the same load, in one run.

Build llama.cpp once with `benchmarks/peers/setup_llamacpp.sh`. Then:

    python benchmarks/peers/llamacpp_serve.py [--model FILE.gguf] [--rounds 2] [--concurrency 32]
        [--rate 2] [--conveyor-args "--dtype float32"]

Both servers get the workload of `conveyor bench serve` (the same client code and seeds): prompts
of 32-256 random token ids, 16-256 output tokens with ignore_eos, streamed through
`/v1/completions`; first `--concurrency` streams at once (all requests queued, at most that many
in flight), then Poisson arrivals at `--rate` req/s (the TTFT comparison at an equal rate).
llama-server runs with 2 threads, `--parallel` = the concurrency (one slot per stream, continuous
batching on, the default) and a context of slots x 520 tokens. Rounds alternate the order of the
servers; one server runs at a time. Writes benchmarks/results/llamacpp_serve.json and a line in
docs/benchmarks.md, with the CPU model and flags.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import save  # noqa: E402

SERVER = HERE / ".llamacpp" / "bin" / "llama-server"


def llama_server(model: str, slots: int, threads: int):
    """llama-server on a free loopback port (conveyor.bench.serve.ServerProcess: health wait, SIGTERM)."""
    from conveyor.bench.serve import ServerProcess

    return ServerProcess([], command=lambda port: [
        str(SERVER), "-m", model, "-t", str(threads), "-tb", str(threads), "--parallel", str(slots),
        "-c", str(slots * 520), "--host", "127.0.0.1", "--port", str(port)])


def run_workloads(url: str, args, salt: int) -> dict:
    from conveyor.bench.serve import LoadConfig, run_load

    out = {}
    for name, rate, conc in (("concurrent", float("inf"), args.concurrency), ("rate", args.rate, None)):
        cfg = LoadConfig(base_url=f"{url}/v1", num_requests=args.num_requests, request_rate=rate,
                         concurrency=conc, seed=salt, prompt_salt=salt, warmup=1 if name == "concurrent" else 0)
        m = asyncio.run(run_load(cfg))
        m.pop("requests", None)
        out[name] = m
        print(f"  {name}: {m['output_throughput']:.1f} tok/s, TTFT p99 {m['ttft_s']['p99']:.3f} s, "
              f"TPOT p50 {m['tpot_s']['median'] * 1e3:.1f} ms, errors {m['errors']}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a GGUF file (default: the demo model)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rate", type=float, default=2.0, help="req/s of the equal-rate TTFT run")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--name", default=None, help="results name (default: llamacpp_serve[_MODEL]); one per machine kind")
    ap.add_argument("--conveyor-args", default="", help="extra `conveyor serve` flags (e.g. --dtype float32)")
    args = ap.parse_args()
    from conveyor.bench.serve import ServerProcess
    from conveyor.model.loader import demo_model_path
    from conveyor.model.probe_cache import cpu_info

    if not SERVER.exists():
        sys.exit(f"{SERVER} missing: run benchmarks/peers/setup_llamacpp.sh first")
    model = args.model or str(demo_model_path())
    results: dict[str, list[dict]] = {"llama-server": [], "conveyor": []}
    for rnd in range(args.rounds):
        order = ["llama-server", "conveyor"] if rnd % 2 == 0 else ["conveyor", "llama-server"]
        for engine in order:
            print(f"round {rnd + 1}: {engine}", flush=True)
            if engine == "llama-server":
                server = llama_server(model, args.concurrency, args.threads)
            else:
                server = ServerProcess([model, *shlex.split(args.conveyor_args)])
            try:
                results[engine].append(run_workloads(server.url, args, salt=rnd))
            finally:
                server.stop()

    def med(engine: str, run: str, key: str, stat: str | None = None) -> float:
        vals = [r[run][key] if stat is None else r[run][key][stat] for r in results[engine]]
        return statistics.median(vals)

    summary = {}
    for run in ("concurrent", "rate"):
        ours, theirs = med("conveyor", run, "output_throughput"), med("llama-server", run, "output_throughput")
        summary[run] = {"conveyor_tok_s": ours, "llama_server_tok_s": theirs, "throughput_ratio": ours / theirs,
                        "conveyor_ttft_p99_s": med("conveyor", run, "ttft_s", "p99"),
                        "llama_server_ttft_p99_s": med("llama-server", run, "ttft_s", "p99"),
                        "conveyor_tpot_p50_ms": 1e3 * med("conveyor", run, "tpot_s", "median"),
                        "llama_server_tpot_p50_ms": 1e3 * med("llama-server", run, "tpot_s", "median")}
        print(run, {k: round(v, 3) for k, v in summary[run].items()})
    cpu, flags = cpu_info()
    c, r = summary["concurrent"], summary["rate"]
    name = args.name or ("llamacpp_serve" if args.model is None else f"llamacpp_serve_{Path(model).stem}")
    save(name, {"model": model, "cpu": cpu, "cpu_flags": sorted(f for f in flags if "avx" in f or "amx" in f),
                            "conveyor_args": args.conveyor_args, "rounds": args.rounds, "summary": summary,
                            "runs": results},
         f"Conveyor vs llama-server, {Path(model).name}, {cpu}: {args.concurrency} concurrent streams "
         f"{c['conveyor_tok_s']:.0f} vs {c['llama_server_tok_s']:.0f} tok/s ({c['throughput_ratio']:.2f}x); "
         f"{args.rate:g} req/s TTFT p99 {r['conveyor_ttft_p99_s']:.2f} vs {r['llama_server_ttft_p99_s']:.2f} s "
         f"(conveyor serve {args.conveyor_args or 'defaults'}; medians of {args.rounds} interleaved rounds)")


if __name__ == "__main__":
    main()
