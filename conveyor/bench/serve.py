"""`conveyor bench serve`: a load generator for any OpenAI-compatible `/v1/completions` endpoint.

Requests arrive as a Poisson process at `--request-rate` (req/s; `inf` = all at once) and/or
under a cap of `--concurrency` in flight. Prompt and output lengths are drawn uniformly from
ranges; prompts are sent as token ids (exact lengths) or as random words, with `max_tokens` =
the target length and `ignore_eos`, so every request produces exactly its output length.
Each request streams (`stream_options.include_usage`), and the client times every SSE event:

- TTFT: send → first event carrying text;  E2E: send → end of the stream;
- TPOT: (E2E - TTFT) / (output tokens - 1), output tokens from the usage chunk;
- ITL: the gaps between consecutive text-carrying events (one event may carry several
  tokens when the server merges them; then that gap stands for all of them, as in vLLM's
  benchmark_serving).

Reported: throughput (output tok/s, req/s), mean/median/p90/p99 of each latency, goodput
(req/s meeting both `--slo-ttft` and `--slo-tpot`) and errors. `--sweep R1,R2,...` starts
`python -m conveyor serve` itself on a free port and runs the same seeded workload at each rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

PERCENTILES = (50, 90, 99)
WORDS = ("the of and to in is was for on that with as by at from his her it an were are which this be "
         "or has had not but one new first time year two after city world people made state school used "
         "during many would when all more most other years water house music river light small "
         "history family north south early great film game team between found village power work line "
         "group season company area under three long known public station party form best life war").split()


# ---- workload ---------------------------------------------------------------------------------

@dataclass(slots=True)
class RequestSpec:
    index: int
    prompt: list[int] | str
    prompt_len: int           # target (exact for token ids)
    output_len: int           # max_tokens, with ignore_eos
    arrival: float            # seconds after the start of the run


def parse_range(text: str) -> tuple[int, int]:
    """'32:256' -> (32, 256), uniform inclusive; '128' -> (128, 128)."""
    lo, _, hi = text.partition(":")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 1 <= lo_i <= hi_i:
        raise ValueError(f"bad length range {text!r}: want LO:HI with 1 <= LO <= HI")
    return lo_i, hi_i


def parse_rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {text!r}")
    return rate


def arrival_times(n: int, rate: float, rng: random.Random) -> list[float]:
    """Offsets of n Poisson arrivals at `rate` req/s (the first at 0); `inf`: all at 0."""
    times, t = [], 0.0
    for i in range(n):
        if i and math.isfinite(rate):
            t += rng.expovariate(rate)
        times.append(t)
    return times


def make_workload(n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], rate: float, seed: int,
                  prompt_format: str = "ids", token_ids: tuple[int, int] = (1000, 30000),
                  prompt_salt: int = 0) -> list[RequestSpec]:
    """The same seed gives the same lengths at every rate, and arrivals whose gaps scale as
    1/rate (each from its own random stream). Prompt contents come from (seed, prompt_salt):
    a sweep salts each run so that a later run cannot hit the prefix cache of an earlier one."""
    rng, arrivals = random.Random(seed), arrival_times(n, rate, random.Random(seed + 1))
    words = random.Random(f"{seed}/{prompt_salt}")
    specs = []
    for i in range(n):
        p_len, o_len = rng.randint(*prompt_len), rng.randint(*output_len)
        if prompt_format == "ids":
            prompt: list[int] | str = [words.randint(*token_ids) for _ in range(p_len)]
        else:
            prompt = " ".join(words.choice(WORDS) for _ in range(p_len))
        specs.append(RequestSpec(i, prompt, p_len, o_len, arrivals[i]))
    return specs


# ---- one request --------------------------------------------------------------------------------

@dataclass(slots=True)
class RequestResult:
    index: int
    prompt_len: int
    output_len: int                       # target
    arrival: float                        # scheduled, seconds after the start of the run
    start: float | None = None            # actually sent
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int | None = None      # usage.completion_tokens (else tokens counted in events)
    prompt_tokens: int | None = None      # usage.prompt_tokens
    token_times: list[float] = field(default_factory=list)   # text events, seconds after `start`
    error: str | None = "not sent"

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        return tpot(self.ttft, self.e2e, self.output_tokens)

    @property
    def itls(self) -> list[float]:
        return itls(self.token_times)

    def record(self) -> dict:
        d = asdict(self)
        d.pop("token_times")
        d["tpot"], d["events"] = self.tpot, len(self.token_times)
        return d


def tpot(ttft: float | None, e2e: float | None, output_tokens: int | None) -> float | None:
    """Mean time per output token after the first; None below two tokens."""
    if ttft is None or e2e is None or not output_tokens or output_tokens < 2:
        return None
    return (e2e - ttft) / (output_tokens - 1)


def itls(token_times: list[float]) -> list[float]:
    return [b - a for a, b in zip(token_times, token_times[1:])]


def build_body(spec: RequestSpec, model: str, temperature: float) -> dict:
    return {"model": model, "prompt": spec.prompt, "max_tokens": spec.output_len, "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def send_request(client: httpx.AsyncClient, url: str, body: dict, result: RequestResult,
                       t0: float) -> None:
    """Stream one completion into `result` (times relative to `t0`, the start of the run)."""
    start = time.perf_counter()
    result.start, result.error = start - t0, "incomplete"
    counted, done = 0, False
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                result.error = f"HTTP {r.status_code}: {text[:200]}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter() - start
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {str(chunk['error'])[:200]}"
                    return
                tokens = sum(_tokens_in(c) for c in chunk.get("choices") or [])
                if tokens:
                    if not result.token_times:
                        result.ttft = now
                    result.token_times.append(now)
                    counted += tokens
                if usage := chunk.get("usage"):
                    result.output_tokens = usage.get("completion_tokens")
                    result.prompt_tokens = usage.get("prompt_tokens")
        result.e2e = time.perf_counter() - start
        if result.output_tokens is None:
            result.output_tokens = counted
        result.error = None if done and result.token_times else \
            "no tokens received" if done else "stream ended without [DONE]"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        result.error = f"{type(e).__name__}: {e}"[:200]


def _tokens_in(choice: dict) -> int:
    """Tokens carried by one streamed choice: exact with logprobs, else 1 per non-empty text."""
    text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
    if not text:
        return 0
    lp = choice.get("logprobs")
    return len(lp["tokens"]) if isinstance(lp, dict) and lp.get("tokens") else 1


# ---- a run ----------------------------------------------------------------------------------------

@dataclass(slots=True)
class LoadConfig:
    base_url: str
    model: str | None = None
    api_key: str | None = None
    num_requests: int = 64
    request_rate: float = math.inf
    concurrency: int | None = None
    prompt_len: tuple[int, int] = (32, 256)
    output_len: tuple[int, int] = (16, 256)
    prompt_format: str = "ids"
    token_ids: tuple[int, int] = (1000, 30000)
    temperature: float = 0.0
    seed: int = 0
    prompt_salt: int = 0
    timeout: float = 600.0
    warmup: int = 1
    slo_ttft: float = 2.0
    slo_tpot: float = 0.5


def headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def resolve_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model the endpoint serves (`GET /models`)."""
    r = await client.get(f"{base_url}/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def run_load(cfg: LoadConfig, specs: list[RequestSpec] | None = None,
                   transport: httpx.AsyncBaseTransport | None = None) -> dict:
    """Send the workload, return metrics (see `compute_metrics`) plus `config` and `requests`."""
    specs = specs if specs is not None else make_workload(
        cfg.num_requests, cfg.prompt_len, cfg.output_len, cfg.request_rate, cfg.seed, cfg.prompt_format,
        cfg.token_ids, cfg.prompt_salt)
    base = cfg.base_url.rstrip("/")
    url = f"{base}/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout), limits=limits,
                                 headers=headers(cfg.api_key), transport=transport) as client:
        model = cfg.model or await resolve_model(client, base)
        for i in range(cfg.warmup):
            prompt = [cfg.token_ids[0] + i] * 16 if cfg.prompt_format == "ids" else "hello " * 16
            warm = RequestResult(-1, 16, 4, 0.0)
            await send_request(client, url, build_body(RequestSpec(-1, prompt, 16, 4, 0.0), model, cfg.temperature),
                               warm, time.perf_counter())
            if not warm.ok:
                raise RuntimeError(f"warm-up request failed: {warm.error}")
        results = [RequestResult(s.index, s.prompt_len, s.output_len, s.arrival) for s in specs]
        gate = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
        t0 = time.perf_counter()

        async def one(spec: RequestSpec, result: RequestResult) -> None:
            await asyncio.sleep(max(0.0, t0 + spec.arrival - time.perf_counter()))
            body = build_body(spec, model, cfg.temperature)
            if gate is None:
                await send_request(client, url, body, result, t0)
            else:
                async with gate:
                    await send_request(client, url, body, result, t0)

        tasks = [asyncio.create_task(one(s, r)) for s, r in zip(specs, results)]
        _, pending = await asyncio.wait(tasks, timeout=cfg.timeout)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - t0
    for r in results:
        if r.error in ("not sent", "incomplete"):
            r.error = f"timeout ({r.error})"
    out = compute_metrics(results, duration, cfg.slo_ttft, cfg.slo_tpot)
    out["config"] = {**asdict(cfg), "model": model, "request_rate": _json_rate(cfg.request_rate),
                     "api_key": "<set>" if cfg.api_key else None}
    out["requests"] = [r.record() for r in results]
    return out


def _json_rate(rate: float) -> float | str:
    return rate if math.isfinite(rate) else "inf"


# ---- metrics --------------------------------------------------------------------------------------

def summarize(values: list[float]) -> dict | None:
    """mean / median / p90 / p99 (linear interpolation, as numpy) / max; None if empty."""
    if not values:
        return None
    import numpy as np   # lazy: keeps numpy out of the CLI's start-up

    a = np.asarray(values, dtype=float)
    out = {"mean": float(a.mean()), "median": float(np.percentile(a, 50))}
    out.update({f"p{q}": float(np.percentile(a, q)) for q in PERCENTILES if q != 50})
    out["max"] = float(a.max())
    return out


def meets_slo(r: RequestResult, slo_ttft: float, slo_tpot: float) -> bool:
    t = r.tpot
    return r.ok and r.ttft is not None and r.ttft <= slo_ttft and (t is None or t <= slo_tpot)


def compute_metrics(results: list[RequestResult], duration: float, slo_ttft: float, slo_tpot: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    in_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in ok)
    good = sum(meets_slo(r, slo_ttft, slo_tpot) for r in results)
    return {
        "duration_s": duration,
        "num_requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "error_kinds": dict(Counter(r.error.split(":")[0] for r in results if not r.ok)),
        "output_len_mismatches": sum(r.output_tokens != r.output_len for r in ok),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot},
        "goodput": good / duration,
        "slo_attainment": good / len(results) if results else 0.0,
        "ttft_s": summarize([r.ttft for r in ok]),
        "tpot_s": summarize([t for r in ok if (t := r.tpot) is not None]),
        "itl_s": summarize([x for r in ok for x in r.itls]),
        "e2e_s": summarize([r.e2e for r in ok]),
    }


def format_summary(m: dict, title: str = "") -> str:
    lines = [f"==== {title or 'serving benchmark'} ====",
             f"requests          {m['completed']}/{m['num_requests']} completed, {m['errors']} errors"
             + (f" {m['error_kinds']}" if m["errors"] else ""),
             f"duration          {m['duration_s']:.1f} s",
             f"throughput        {m['request_throughput']:.2f} req/s, {m['output_throughput']:.1f} output tok/s, "
             f"{m['total_token_throughput']:.1f} total tok/s",
             f"goodput           {m['goodput']:.2f} req/s ({100 * m['slo_attainment']:.0f}% within TTFT <= "
             f"{m['slo']['ttft_s']:g} s and TPOT <= {m['slo']['tpot_s']:g} s)"]
    if m["output_len_mismatches"]:
        lines.append(f"WARNING           {m['output_len_mismatches']} requests did not produce their target "
                     "length (does the server honour ignore_eos?)")
    lines.append(f"{'(ms)':<12}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}{'max':>10}")
    for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        s = m[key]
        cells = "".join(f"{1000 * s[k]:>10.1f}" for k in ("mean", "median", "p90", "p99", "max")) if s else "   -"
        lines.append(f"{name:<12}{cells}")
    return "\n".join(lines)


# ---- plots ----------------------------------------------------------------------------------------

def _pyplot():
    import matplotlib   # lazy: optional dependency (matplotlib)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt   # lazy: optional dependency (matplotlib)

    return plt


def plot_run(m: dict, path: str | Path) -> None:
    """CDFs of TTFT, TPOT and E2E, and TTFT / E2E against the time each request was sent."""
    import numpy as np   # lazy: keeps numpy out of the CLI's start-up

    plt = _pyplot()
    reqs = [r for r in m["requests"] if r["error"] is None]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "E2E")):
        xs = np.sort([r[key] for r in reqs if r[key] is not None])
        if len(xs):
            a.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=label)
    a.set(xscale="log", xlabel="seconds", ylabel="fraction of requests", title="latency CDF")
    a.grid(alpha=0.3)
    a.legend()
    starts = [r["start"] for r in reqs]
    b.scatter(starts, [r["ttft"] for r in reqs], s=10, label="TTFT")
    b.scatter(starts, [r["e2e"] for r in reqs], s=10, label="E2E")
    b.set(xlabel="request sent at (s)", ylabel="seconds", title="latency over the run")
    b.grid(alpha=0.3)
    b.legend()
    rate = m["config"]["request_rate"]
    fig.suptitle(f"{m['config']['model']}: {m['num_requests']} requests, rate {rate}, "
                 f"concurrency {m['config']['concurrency'] or 'unbounded'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(sweep: dict, path: str | Path) -> None:
    """Throughput, TTFT and TPOT (p50, p99) against the request rate."""
    plt = _pyplot()
    runs = sweep["runs"]
    rates = [r["request_rate"] for r in runs]
    if any(isinstance(x, str) for x in rates):   # 'inf': a categorical axis
        rates = [_rate_str(x) for x in rates]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    a = axes[0]
    a.plot(rates, [r["output_throughput"] for r in runs], "o-", label="output tok/s")
    a.set(xlabel="request rate (req/s)", ylabel="output tok/s", title="throughput")
    a2 = a.twinx()
    a2.plot(rates, [r["request_throughput"] for r in runs], "s--", color="C1", label="req/s completed")
    a2.plot(rates, [r["goodput"] for r in runs], "^:", color="C2", label="goodput (req/s in SLO)")
    a2.set_ylabel("req/s")
    a.legend(loc="upper left")
    a2.legend(loc="lower right")
    for ax, key, name in ((axes[1], "ttft_s", "TTFT"), (axes[2], "tpot_s", "TPOT")):
        for q, style in (("median", "o-"), ("p99", "s--")):
            ax.plot(rates, [(r[key] or {}).get(q, math.nan) for r in runs], style, label=f"{name} {q}")
        slo = runs[0]["slo"]["ttft_s" if key == "ttft_s" else "tpot_s"]
        ax.axhline(slo, color="gray", lw=0.8, ls=":", label="SLO")
        ax.set(xlabel="request rate (req/s)", ylabel="seconds", title=name, yscale="log")
        ax.legend()
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.set_xticks(range(len(rates)) if isinstance(rates[0], str) else rates, [_rate_str(x) for x in rates])
    fig.suptitle(sweep.get("title", "serving benchmark"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- a server of our own, for sweeps ----------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m conveyor serve ARGS` on a free loopback port; `stop()` sends SIGTERM. `command`
    (port -> argv) starts another OpenAI-compatible server instead (a peer, e.g. llama-server)."""

    def __init__(self, server_args: list[str], startup_timeout: float = 300.0, log_path: str | None = None,
                 command=None):
        self.port = free_port()
        if log_path is None:
            fd, self.log_path = tempfile.mkstemp(prefix="conveyor-serve-", suffix=".log")
            self._log = os.fdopen(fd, "wb")
        else:
            self.log_path, self._log = log_path, open(log_path, "wb")
        cmd = command(self.port) if command is not None else [
            sys.executable, "-m", "conveyor", "serve", "--host", "127.0.0.1", "--port", str(self.port), *server_args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=os.environ.copy())
        try:
            self._wait_healthy(startup_timeout)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


COUNTERS = ("conveyor:num_preemptions_total", "conveyor:prefix_cache_queries_total",
            "conveyor:prefix_cache_hits_total")


def scrape_counters(url: str, prefixes: tuple[str, ...] = COUNTERS) -> dict[str, float]:
    """Sums of Prometheus samples by metric name (over labels) for names starting with `prefixes`."""
    out: dict[str, float] = {}
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return out
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(prefixes):
            continue
        name, _, value = line.rpartition(" ")
        name = name.split("{")[0]
        out[name] = out.get(name, 0.0) + float(value)
    return out


def run_sweep(cfg: LoadConfig, rates: list[float], server_args: list[str], log=print) -> dict:
    """Start a Conveyor server, run the same seeded workload at each rate, stop the server.
    Each run has fresh prompt contents (same lengths): repeated prompts would hit the prefix cache."""
    runs = []
    with ServerProcess(server_args) as server:
        log(f"server up on {server.url} (log: {server.log_path})")
        for i, rate in enumerate(rates):
            before = scrape_counters(server.url)
            run_cfg = LoadConfig(**{**asdict(cfg), "base_url": f"{server.url}/v1", "request_rate": rate,
                                    "warmup": cfg.warmup if i == 0 else 0, "prompt_salt": cfg.prompt_salt + i})
            m = asyncio.run(run_load(run_cfg))
            after = scrape_counters(server.url)
            m["request_rate"] = _json_rate(rate)
            m["server"] = {k.removeprefix("conveyor:"): v - before.get(k, 0.0) for k, v in after.items()}
            log(format_summary(m, f"rate {rate:g} req/s"))
            runs.append(m)
        server.stop()
        status = server.proc.returncode
    c = {**runs[0]["config"], "request_rate": [_json_rate(r) for r in rates], "warmup": cfg.warmup}
    return {"title": f"{c['model']}: {cfg.num_requests} requests per rate, prompts {cfg.prompt_len[0]}-"
                     f"{cfg.prompt_len[1]}, outputs {cfg.output_len[0]}-{cfg.output_len[1]} tokens",
            "server_args": server_args, "server_exit_status": status, "config": c, "runs": runs}


def _rate_str(rate: float | str) -> str:
    return rate if isinstance(rate, str) else f"{rate:g}"


def sweep_line(sweep: dict) -> str:
    """One line for docs/benchmarks.md: each figure given per rate, as a/b/c."""
    runs, c = sweep["runs"], sweep["config"]

    def per_rate(fmt) -> str:
        return "/".join(fmt(r) for r in runs)

    def ms(key: str, q: str) -> str:
        return per_rate(lambda r: f"{1000 * r[key][q]:.0f}" if r[key] else "-")

    def num(key: str, digits: int) -> str:
        return per_rate(lambda r: f"{r[key]:.{digits}f}")

    server = " ".join(sweep["server_args"]) or "defaults"
    return (f"rates {per_rate(lambda r: _rate_str(r['request_rate']))} req/s, {c['num_requests']} reqs each "
            f"(prompts {c['prompt_len'][0]}-{c['prompt_len'][1]}, outputs {c['output_len'][0]}-"
            f"{c['output_len'][1]} tokens; server: {server}): "
            f"output {num('output_throughput', 0)} tok/s, "
            f"TTFT p50 {ms('ttft_s', 'median')} / p99 {ms('ttft_s', 'p99')} ms, "
            f"TPOT p50 {ms('tpot_s', 'median')} / p99 {ms('tpot_s', 'p99')} ms, "
            f"goodput {num('goodput', 2)} req/s, "
            f"errors {per_rate(lambda r: str(r['errors']))}")


# ---- command line ---------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="OpenAI-compatible API root")
    t.add_argument("--model", default=None, help="model name to send (none: the first of GET /models)")
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token ($OPENAI_API_KEY if set)")
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=64, help="requests per run")
    w.add_argument("--request-rate", type=parse_rate, default="inf",
                   help="Poisson arrival rate in req/s ('inf': all at once)")
    w.add_argument("--concurrency", type=int, default=None, help="most requests in flight (none: no cap)")
    w.add_argument("--prompt-len", type=parse_range, default="32:256", help="prompt tokens, uniform LO:HI")
    w.add_argument("--output-len", type=parse_range, default="16:256", help="output tokens, uniform LO:HI")
    w.add_argument("--prompt-format", choices=("ids", "text"), default="ids",
                   help="prompts as token ids (exact lengths) or random words (about one token each)")
    w.add_argument("--token-ids", type=parse_range, default="1000:30000", help="range of random prompt token ids")
    w.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    w.add_argument("--seed", type=int, default=0, help="seed of lengths, prompts and arrivals")
    w.add_argument("--prompt-salt", type=int, default=0,
                   help="varies prompt contents only (same lengths): repeating a run against the same "
                        "server would otherwise hit its prefix cache (a sweep adds the run's index)")
    w.add_argument("--warmup", type=int, default=1, help="short requests sent (and not measured) first")
    w.add_argument("--timeout", type=float, default=600.0,
                   help="hard limit of a run, in seconds: requests still open then count as errors")
    s = p.add_argument_group("report")
    s.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO on TTFT, seconds")
    s.add_argument("--slo-tpot", type=float, default=0.5, help="goodput SLO on TPOT, seconds")
    s.add_argument("--out", default=None, help="write the results JSON here")
    s.add_argument("--plot", default=None, help="write the plot (PNG) here (none: next to --out, as .png)")
    d = p.add_argument_group("sweep (starts its own server)")
    d.add_argument("--sweep", default=None, help="comma-separated request rates, e.g. 0.5,1,2: start "
                   "'python -m conveyor serve' on a free port and run the workload at each (--base-url ignored)")
    d.add_argument("--server-args", default="",
                   help="arguments for 'conveyor serve', e.g. --server-args='--max-num-seqs 64'")


def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser("serve", help="load-test an OpenAI-compatible server",
                                    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                    description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(func=cmd_bench_serve)
    return p


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    if args.num_requests < 1 or (args.concurrency is not None and args.concurrency < 1):
        raise ValueError("--num-requests and --concurrency must be >= 1")
    return LoadConfig(base_url=args.base_url, model=args.model, api_key=args.api_key,
                      num_requests=args.num_requests, request_rate=args.request_rate,
                      concurrency=args.concurrency, prompt_len=args.prompt_len, output_len=args.output_len,
                      prompt_format=args.prompt_format, token_ids=args.token_ids, temperature=args.temperature,
                      seed=args.seed, prompt_salt=args.prompt_salt, timeout=args.timeout, warmup=args.warmup,
                      slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot)


def run_from_args(args: argparse.Namespace) -> dict:
    """A single run (printed) or, with --sweep, a sweep; writes --out / --plot when given."""
    cfg = config_from_args(args)
    if args.sweep:
        result = run_sweep(cfg, [parse_rate(x) for x in args.sweep.split(",")], shlex.split(args.server_args))
    else:
        result = asyncio.run(run_load(cfg))
        print(format_summary(result, f"{result['config']['model']} at {args.base_url}"))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    plot = args.plot or (str(Path(args.out).with_suffix(".png")) if args.out else None)
    if plot:
        (plot_sweep if args.sweep else plot_run)(result, plot)
        print(f"wrote {plot}")
    return result


def cmd_bench_serve(args: argparse.Namespace) -> int:
    result = run_from_args(args)
    runs = result["runs"] if "runs" in result else [result]
    return 1 if all(r["completed"] == 0 for r in runs) else 0
