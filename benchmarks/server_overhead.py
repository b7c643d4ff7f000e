"""Does the HTTP server slow the engine loop? The same workload offline and through the server.

Workload: N requests given at once, distinct short prompts, greedy, ignore_eos, M tokens each.
- offline: LLM.generate's step loop in this process, on a worker thread like the server's
  engine loop (torch's OpenMP pool behaves differently on the main thread of a busy 2-core box);
- stream / full: the same engine config behind `conveyor serve`'s app (uvicorn thread + engine
  thread in this process), driven by N concurrent clients in a child process, streaming
  (one SSE event per token) or not.
Variants run interleaved `--repeats` times; medians and ratios against offline from the same run.
Reported: wall time, generated tok/s, steps, mean time inside Engine.step(), the gap between
steps (loop overhead: waiting for the GIL, handing outputs to the event loop), and the CPU
seconds of the server's event-loop thread (HTTP, JSON, SSE) and of the client process.

    python benchmarks/server_overhead.py [--requests 32] [--max-tokens 64] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import torch
import uvicorn

from common import save
from conveyor.transport.thread import AsyncEngine
from conveyor.engine.engine import Engine, EngineConfig
from conveyor.model.loader import load_model
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler.config import SchedulerConfig
from conveyor.server.app import build_app

TOPICS = ["the sea", "a city", "winter", "machines", "a garden", "the moon", "music", "a river", "bread",
          "trains", "a library", "mountains", "rain", "a market", "clocks", "birds"]

CLIENT = r"""
import asyncio, json, sys, time, httpx
url, n, max_tokens, stream = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
prompts = json.loads(sys.stdin.read())
async def one(http, prompt):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    if not stream:
        r = await http.post("/v1/completions", json=body)
        return r.json()["usage"]["completion_tokens"], 1
    events = 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            events += line.startswith("data:")
    return max_tokens, events
async def main():
    limits = httpx.Limits(max_connections=n + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        await http.get("/health")
        t0, c0 = time.perf_counter(), time.process_time()
        res = await asyncio.gather(*(one(http, p) for p in prompts))
        print(json.dumps({"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0,
                          "tokens": sum(t for t, _ in res), "events": sum(e for _, e in res)}))
asyncio.run(main())
"""


def prompts(n: int) -> list[str]:
    return [f"Write a short poem about {TOPICS[i % len(TOPICS)]} (number {i})." for i in range(n)]


def config(n: int) -> EngineConfig:
    return EngineConfig(num_kv_blocks=512, block_size=16,
                        scheduler=SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=1024))


def on_worker_thread(fn):
    result = []
    t = threading.Thread(target=lambda: result.append(fn()))
    t.start()
    t.join()
    return result[0]


def run_offline(loaded, ps: list[str], max_tokens: int) -> dict:
    engine = Engine(config(len(ps)), loaded=loaded)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for p in ps:
        engine.add_request(p, params)
    step_time, steps, tokens = 0.0, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += sum(len(c.delta_token_ids) for c in out.outputs)
        step_time += engine.last_step_time
        steps += 1
    return _summary(time.perf_counter() - t0, tokens, steps, step_time)


def run_server(loaded, ps: list[str], max_tokens: int, stream: bool) -> dict:
    engine = AsyncEngine(Engine(config(len(ps)), loaded=loaded))
    app = build_app(engine, log_interval=0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    before, loop_cpu = engine.stats(), thread_cpu(thread)
    client = subprocess.run([sys.executable, "-c", CLIENT, f"http://127.0.0.1:{port}", str(len(ps)),
                             str(max_tokens), "1" if stream else "0"],
                            input=json.dumps(ps), capture_output=True, text=True, check=True)
    result = json.loads(client.stdout)
    after = engine.stats()
    loop_cpu = thread_cpu(thread) - loop_cpu
    server.should_exit = True
    thread.join()
    steps = after.steps - before.steps
    out = _summary(result["wall"], result["tokens"], steps, after.step_time_total - before.step_time_total)
    out.update(sse_events=result["events"], loop_cpu_s=loop_cpu, client_cpu_s=result["cpu"])
    return out


def thread_cpu(thread: threading.Thread) -> float:
    """CPU seconds (user + system) of one thread of this process, from /proc."""
    fields = open(f"/proc/self/task/{thread.native_id}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")



def _summary(wall: float, tokens: int, steps: int, step_time: float) -> dict:
    return {"wall_s": wall, "gen_tok_s": tokens / wall, "tokens": tokens, "steps": steps,
            "step_ms": 1000 * step_time / max(steps, 1), "gap_ms": 1000 * (wall - step_time) / max(steps, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(None, "cpu", torch.float32)
    ps = prompts(args.requests)
    on_worker_thread(lambda: run_offline(loaded, ps[:4], 4))   # warm-up (kernels, allocator)
    runs: dict[str, list[dict]] = {"offline": [], "stream": [], "full": []}
    for r in range(args.repeats):
        runs["offline"].append(on_worker_thread(lambda: run_offline(loaded, ps, args.max_tokens)))
        runs["stream"].append(run_server(loaded, ps, args.max_tokens, stream=True))
        runs["full"].append(run_server(loaded, ps, args.max_tokens, stream=False))
        print(f"repeat {r}: " + ", ".join(f"{k} {v[-1]['gen_tok_s']:.1f} tok/s" for k, v in runs.items()), flush=True)
    med = {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in runs.items()}
    # Ratios per repeat (same conditions), then the median: robust to a noisy shared machine.
    ratio = {k: statistics.median(s["gen_tok_s"] / o["gen_tok_s"] for s, o in zip(runs[k], runs["offline"]))
             for k in ("stream", "full")}
    for k, v in med.items():
        cpu = f"  loop cpu {v['loop_cpu_s']:.2f}s  client cpu {v['client_cpu_s']:.2f}s" if "loop_cpu_s" in v else ""
        print(f"{k:8s} wall {v['wall_s']:.2f}s  {v['gen_tok_s']:.1f} tok/s  steps {v['steps']:.0f}  "
              f"step {v['step_ms']:.1f} ms  gap {v['gap_ms']:.2f} ms{cpu}")
    print(f"throughput vs offline: stream {ratio['stream']:.3f}, full {ratio['full']:.3f}")
    save(f"server_overhead_t{args.threads}", {"args": vars(args), "runs": runs, "median": med, "ratio_vs_offline": ratio},
         f"server vs offline generation throughput ({args.threads} torch threads), {args.requests} clients x {args.max_tokens} tokens: "
         f"streaming {ratio['stream']:.2f}x, non-streaming {ratio['full']:.2f}x; engine step "
         f"{med['offline']['step_ms']:.1f} ms offline vs {med['stream']['step_ms']:.1f} ms streaming")


if __name__ == "__main__":
    main()
