"""The serving load generator: metrics from synthetic timestamps, the arrival process, the SSE
client against a fake endpoint, and one small run against a real `conveyor serve` process."""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics

import httpx
import pytest

from conveyor.bench.serve import (LoadConfig, RequestResult, ServerProcess, arrival_times, compute_metrics,
                                  format_summary, itls, make_workload, parse_range, parse_rate, plot_sweep,
                                  run_load, summarize, sweep_line, tpot)


def result(i: int, ttft: float, token_times: list[float], e2e: float, out: int, target: int | None = None,
           error: str | None = None) -> RequestResult:
    r = RequestResult(i, prompt_len=10, output_len=target or out, arrival=0.0, start=float(i), ttft=ttft,
                      e2e=e2e, output_tokens=out, prompt_tokens=10, token_times=token_times, error=error)
    return r


# ---- metrics ------------------------------------------------------------------------------------

def test_tpot_and_itl_from_timestamps():
    times = [0.5, 0.6, 0.8, 1.1]
    assert itls(times) == pytest.approx([0.1, 0.2, 0.3])
    assert tpot(0.5, 1.1, 4) == pytest.approx(0.2)        # (1.1 - 0.5) / 3
    assert tpot(0.5, 0.5, 1) is None and tpot(None, 1.0, 4) is None
    r = result(0, 0.5, times, 1.1, 4)
    assert r.tpot == pytest.approx(0.2) and r.itls == pytest.approx([0.1, 0.2, 0.3])


def test_summarize_percentiles():
    s = summarize([float(x) for x in range(1, 101)])
    assert s["mean"] == pytest.approx(50.5) and s["median"] == pytest.approx(50.5)
    assert s["p90"] == pytest.approx(90.1) and s["p99"] == pytest.approx(99.01) and s["max"] == 100
    assert summarize([]) is None
    assert summarize([3.0])["p99"] == 3.0


def test_compute_metrics_throughput_goodput_errors():
    results = [
        result(0, 0.5, [0.5, 0.6, 0.7], 0.7, 3),                   # tpot 0.1: in SLO
        result(1, 3.0, [3.0, 3.1], 3.1, 2),                         # ttft over 2 s
        result(2, 1.0, [1.0, 2.0, 3.0], 3.0, 3),                    # tpot 1.0 over 0.5 s
        result(3, 0.2, [0.2], 0.2, 1),                              # one token: no tpot, in SLO
        result(4, 0.4, [0.4, 0.5], 0.5, 2, target=5),               # short of its target
        RequestResult(5, 10, 8, 0.0, error="HTTP 503: overloaded"),
        RequestResult(6, 10, 8, 0.0, error="timeout (not sent)"),
    ]
    m = compute_metrics(results, duration=10.0, slo_ttft=2.0, slo_tpot=0.5)
    assert m["num_requests"] == 7 and m["completed"] == 5 and m["errors"] == 2
    assert m["error_kinds"] == {"HTTP 503": 1, "timeout (not sent)": 1}
    assert m["output_len_mismatches"] == 1
    assert m["total_output_tokens"] == 11 and m["total_input_tokens"] == 50
    assert m["output_throughput"] == pytest.approx(1.1) and m["request_throughput"] == pytest.approx(0.5)
    assert m["goodput"] == pytest.approx(0.3)                      # requests 0, 3, 4
    assert m["slo_attainment"] == pytest.approx(3 / 7)
    assert m["ttft_s"]["mean"] == pytest.approx((0.5 + 3.0 + 1.0 + 0.2 + 0.4) / 5)
    assert m["ttft_s"]["median"] == pytest.approx(0.5)
    assert m["tpot_s"]["mean"] == pytest.approx((0.1 + 0.1 + 1.0 + 0.1) / 4)
    assert m["itl_s"]["max"] == pytest.approx(1.0)
    assert sorted(m["e2e_s"]) == ["max", "mean", "median", "p90", "p99"]
    assert "TTFT" in format_summary(m) and "WARNING" in format_summary(m)
    json.dumps(m)


# ---- workload -----------------------------------------------------------------------------------

def test_poisson_arrivals_have_the_mean_rate():
    for rate in (0.5, 4.0, 50.0):
        times = arrival_times(20000, rate, random.Random(0))
        assert times[0] == 0.0 and times == sorted(times)
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.03)
        assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.05)   # exponential


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(100, math.inf, random.Random(0)) == [0.0] * 100
    assert parse_rate("inf") == math.inf
    with pytest.raises(ValueError):
        parse_rate("0")


def test_workload_lengths_and_seed():
    a = make_workload(200, (32, 256), (16, 256), 2.0, seed=7)
    assert all(32 <= s.prompt_len <= 256 and len(s.prompt) == s.prompt_len for s in a)
    assert all(16 <= s.output_len <= 256 for s in a)
    assert all(1000 <= t <= 30000 for s in a for t in s.prompt)
    b = make_workload(200, (32, 256), (16, 256), 4.0, seed=7)
    assert [s.prompt for s in a] == [s.prompt for s in b] and [s.output_len for s in a] == [s.output_len for s in b]
    assert [s.arrival for s in b] == pytest.approx([s.arrival / 2 for s in a])   # same draws, twice the rate
    c = make_workload(200, (32, 256), (16, 256), 2.0, seed=7, prompt_salt=1)   # a sweep's next run
    assert [s.prompt_len for s in c] == [s.prompt_len for s in a] and [s.arrival for s in c] == [s.arrival for s in a]
    assert all(x.prompt[:16] != y.prompt[:16] for x, y in zip(a, c))            # no prefix-cache hits
    assert [s.prompt for s in make_workload(5, (8, 8), (4, 4), 1.0, seed=8)] != [s.prompt for s in a[:5]]
    text = make_workload(3, (20, 20), (4, 4), 1.0, seed=0, prompt_format="text")
    assert all(len(s.prompt.split()) == 20 for s in text)
    assert parse_range("128") == (128, 128) and parse_range("16:256") == (16, 256)
    with pytest.raises(ValueError):
        parse_range("256:16")


# ---- the client against a fake endpoint --------------------------------------------------------------

def fake_server(gap: float = 0.02, fail_every: int = 0, truncate: bool = False):
    """/v1/completions streaming one event per token, `gap` seconds apart (an error every n-th;
    `truncate`: the stream stops before the usage chunk and [DONE])."""
    seen = []

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "fake-model"}]})
        body = json.loads(request.content)
        seen.append(body)
        if fail_every and len(seen) % fail_every == 0:
            return httpx.Response(503, json={"error": {"message": "overloaded"}})

        async def events():
            for i in range(body["max_tokens"]):
                await asyncio.sleep(gap)
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f' t{i}'}], 'usage': None})}\n\n".encode()
            if truncate:
                return
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode()

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())

    return httpx.MockTransport(handler), seen


def test_client_times_a_fake_stream():
    transport, seen = fake_server(gap=0.02, fail_every=4)
    cfg = LoadConfig(base_url="http://fake/v1", num_requests=8, request_rate=math.inf, concurrency=3,
                     prompt_len=(5, 9), output_len=(4, 6), warmup=0)
    m = asyncio.run(run_load(cfg, transport=transport))
    assert m["config"]["model"] == "fake-model" and m["config"]["request_rate"] == "inf"
    assert all(b["ignore_eos"] and b["stream"] and b["stream_options"] == {"include_usage": True} for b in seen)
    assert m["completed"] == 6 and m["errors"] == 2 and m["error_kinds"] == {"HTTP 503": 2}
    assert m["output_len_mismatches"] == 0
    for r in m["requests"]:
        if r["error"] is None:
            assert r["output_tokens"] == r["output_len"] == r["events"]
            assert r["prompt_tokens"] == r["prompt_len"]
            assert r["ttft"] >= 0.015 and r["e2e"] >= r["ttft"] + 0.015 * (r["output_len"] - 1)
    # the fake stream's sleeps bound the gaps from below; how far above is the machine's business
    assert m["itl_s"]["median"] > 0.015 and m["tpot_s"]["median"] > 0.015
    json.dumps(m)


def test_hard_timeout_counts_open_requests_as_errors():
    # One request takes at least 1.2 s (3 tokens 0.4 s apart), so a second can never finish within 2 s,
    # and the first has 0.8 s to spare however busy the machine.
    transport, _ = fake_server(gap=0.4)
    cfg = LoadConfig(base_url="http://fake/v1", model="m", num_requests=4, concurrency=1, output_len=(3, 3),
                     warmup=0, timeout=2.0)
    m = asyncio.run(run_load(cfg, transport=transport))
    assert m["completed"] == 1 and m["errors"] == 3 and m["duration_s"] < 4 * 1.2   # not waited out
    assert set(m["error_kinds"]) <= {"timeout (incomplete)", "timeout (not sent)"}


def test_truncated_stream_is_an_error():
    transport, _ = fake_server(gap=0.0, truncate=True)
    cfg = LoadConfig(base_url="http://fake/v1", model="m", num_requests=2, output_len=(3, 3), warmup=0)
    m = asyncio.run(run_load(cfg, transport=transport))
    assert m["completed"] == 0 and m["error_kinds"] == {"stream ended without [DONE]": 2}
    assert m["ttft_s"] is None and "-" in format_summary(m)


def test_sweep_line_and_plot(tmp_path):
    def run(rate, tok_s):
        m = compute_metrics([result(0, 0.5, [0.5, 0.6], 0.6, 2)], 1.0, 2.0, 0.5)
        return {**m, "request_rate": rate, "output_throughput": tok_s}

    sweep = {"title": "t", "server_args": ["--max-num-seqs", "64"], "config": {
        "num_requests": 1, "prompt_len": [32, 256], "output_len": [16, 256]},
        "runs": [run(0.5, 60.0), run(1.0, 110.0), run("inf", 130.0)]}
    line = sweep_line(sweep)
    assert line.startswith("rates 0.5/1/inf req/s") and "output 60/110/130 tok/s" in line
    plot_sweep({**sweep, "runs": sweep["runs"][:2]}, tmp_path / "s.png")
    assert (tmp_path / "s.png").stat().st_size > 1000


# ---- a real server ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_against_a_real_server(tmp_path):
    from conveyor.cli import main

    with ServerProcess(["--num-kv-blocks", "256", "--max-num-seqs", "8", "--log-interval", "0"]) as server:
        out = tmp_path / "r.json"
        rc = main(["bench", "serve", "--base-url", f"{server.url}/v1", "--num-requests", "6", "--request-rate",
                   "20", "--prompt-len", "16:48", "--output-len", "8", "--seed", "3", "--out", str(out)])
        assert rc == 0
        assert server.stop() == 0
    m = json.loads(out.read_text())
    assert m["completed"] == 6 and m["errors"] == 0 and m["output_len_mismatches"] == 0
    assert m["total_output_tokens"] == 48
    for r in m["requests"]:
        assert r["output_tokens"] == 8 and r["prompt_tokens"] == r["prompt_len"] and 16 <= r["prompt_len"] <= 48
        assert 0 < r["ttft"] <= r["e2e"] and r["tpot"] > 0 and 1 <= r["events"] <= 8
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert set(m[key]) == {"mean", "median", "p90", "p99", "max"}
    assert m["output_throughput"] > 0 and 0 <= m["goodput"] <= m["request_throughput"]
    assert m["config"]["request_rate"] == 20 and m["config"]["model"]
    assert (tmp_path / "r.png").stat().st_size > 1000
