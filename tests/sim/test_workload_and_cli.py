"""Workload generation and traces; the `conveyor simulate` and `conveyor plot` commands."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics

import pytest

from conveyor.cli import main
from conveyor.core.trace import StepTracer
from conveyor.sim.cli import find_max_rate, parse_slo
from conveyor.sim.workload import LengthDist, WorkloadSpec, arrival_times, load_trace, save_trace


def test_length_distributions():
    rng = random.Random(0)
    assert {LengthDist.parse("5").sample(rng) for _ in range(10)} == {5}
    xs = [LengthDist.parse("10:20").sample(rng) for _ in range(2000)]
    assert min(xs) == 10 and max(xs) == 20
    logn = [LengthDist.parse("lognormal:100:0.5:400").sample(rng) for _ in range(4000)]
    assert 90 < statistics.median(logn) < 110 and max(logn) == 400
    assert 45 < statistics.mean(LengthDist.parse("exp:50").sample(rng) for _ in range(4000)) < 55
    for bad in ("0:5", "20:10", "lognormal:5", "zipf:3", "x"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_arrival_processes():
    rng = random.Random(1)
    poisson = arrival_times(5000, 10.0, "poisson", rng)
    gaps = [b - a for a, b in zip(poisson, poisson[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.05)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.1)
    bursty = arrival_times(5000, 10.0, "gamma:3", rng)
    g = [b - a for a, b in zip(bursty, bursty[1:])]
    assert statistics.mean(g) == pytest.approx(0.1, rel=0.1) and statistics.stdev(g) / statistics.mean(g) > 2.5
    assert arrival_times(3, 4.0, "constant", rng) == [0.0, 0.25, 0.5]
    assert arrival_times(3, math.inf, "poisson", rng) == [0.0, 0.0, 0.0]


def test_workload_spec_prefix_groups_priorities_and_rate_independence():
    spec = WorkloadSpec(num_requests=400, rate=5, prompt_len="40:80", output_len="10", max_tokens="200",
                        prefix_groups=2, prefix_len=32, prefix_share=0.5, priorities={0: 3, 5: 1}, seed=3)
    wl = spec.generate()
    grouped = [r for r in wl if r.prefix_group is not None]
    assert 150 < len(grouped) < 250 and all(r.prefix_len == 32 for r in grouped)
    a, b = [r for r in grouped if r.prefix_group == 0][:2]
    ta, tb = a.prompt_token_ids(wl.index(a)), b.prompt_token_ids(wl.index(b))
    assert ta[:32] == tb[:32] and ta[32:] != tb[32:]
    assert {r.priority for r in wl} == {0, 5} and all(r.max_tokens == 200 and r.output_len == 10 for r in wl)
    slower = dataclasses.replace(spec, rate=1).generate()   # the same lengths, groups and priorities
    assert [(r.prompt_len, r.priority, r.prefix_group) for r in slower] == \
        [(r.prompt_len, r.priority, r.prefix_group) for r in wl]
    assert slower[-1].arrival > 3 * wl[-1].arrival


def test_trace_round_trip(tmp_path):
    wl = WorkloadSpec(num_requests=20, rate=3, prefix_groups=2, prefix_len=8, seed=1).generate()
    save_trace(wl, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == wl
    (tmp_path / "bad.jsonl").write_text('{"arrival": 1, "prompt_len": 5}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_trace(tmp_path / "bad.jsonl")
    (tmp_path / "late.jsonl").write_text('{"arrival": 10, "prompt_len": 5, "output_len": 2}\n'
                                         '{"arrival": 12.5, "prompt_len": 5, "output_len": 2}\n')
    assert [r.arrival for r in load_trace(tmp_path / "late.jsonl")] == [0.0, 2.5]


def test_parse_slo():
    assert parse_slo("ttft_p99=2s,tpot_p50=100ms, e2e_mean=3") == {"ttft_p99": 2.0, "tpot_p50": 0.1, "e2e_mean": 3.0}
    for bad in ("ttft=2", "latency_p50=1", ""):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_find_max_rate_brackets_the_threshold():
    class Fake:   # meets the SLO below 3.7 req/s
        def __init__(self, rate):
            self.rate = rate

        def meets(self, slo):
            return self.rate <= 3.7

    rate, res = find_max_rate(Fake, {"ttft_p99": 1.0})
    assert 3.6 < rate <= 3.7 and res.meets({})


def run_cli(*argv, capsys) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_simulate_command_sweep_trace_and_plot(tmp_path, capsys):
    out = run_cli("simulate", "--num-requests", "80", "--rate", "3", "--sweep", "max_num_seqs=4,16", "--slo", "ttft_p99=5s",
                  "--step-trace", str(tmp_path / "trace.json"), "--out", str(tmp_path / "r.json"), capsys=capsys)
    assert "max_num_seqs=4" in out and "max_num_seqs=16" in out and "goodput" in out
    report = json.loads((tmp_path / "r.json").read_text())
    runs = report["runs"]
    assert [r["max_num_seqs"] for r in runs] == ["4", "16"]
    assert runs[0]["summary"]["p99_ttft_s"] > runs[1]["summary"]["p99_ttft_s"]
    trace = StepTracer.load(tmp_path / "trace.json")
    assert trace.records and max(r.running for r in trace.records) <= 16
    assert json.loads((tmp_path / "trace.chrome.json").read_text())["traceEvents"]
    png = tmp_path / "t.png"
    run_cli("plot", str(tmp_path / "trace.json"), str(tmp_path / "trace.json"), "--labels", "a,b", "-o", str(png),
            capsys=capsys)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_capacity_planning_on_a_gpu(tmp_path, capsys):
    out = run_cli("simulate", "--gpu", "h200", "--model", "llama-3.1-8b", "--num-requests", "300",
                  "--rate", "40", "--prompt-len", "256:1024", "--output-len", "64:256", "--find-replicas",
                  "--slo", "ttft_p99=1s,tpot_p50=40ms", "--out", str(tmp_path / "r.json"), capsys=capsys)
    (run,) = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert run["replicas"] >= 1 and run["gpus"] == run["replicas"] and "H200" in out
    assert run["summary"]["slo_met"]
    out = run_cli("simulate", "--gpu", "h200", "--model", "llama-3.1-8b", "--num-requests", "300",
                  "--prompt-len", "256:1024", "--output-len", "64:256", "--find-max-rate",
                  "--slo", "ttft_p99=1s,tpot_p50=40ms", "--out", str(tmp_path / "m.json"), capsys=capsys)
    (run,) = json.loads((tmp_path / "m.json").read_text())["runs"]
    assert run["max_rate"] > 1 and "max rate" in out


def test_simulate_command_sensitivity(tmp_path, capsys):
    out = run_cli("simulate", "--num-requests", "60", "--rate", "1", "--sensitivity", "--out", str(tmp_path / "r.json"),
                  capsys=capsys)
    (run,) = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert set(run["elasticity"]) == {"ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "throughput"}
    assert run["elasticity"]["ttft_p50"] >= 0.9 and "change per 1% of every step cost" in out
    # a roofline model has no step-cost curve to move: refused, not ignored
    assert main(["simulate", "--gpu", "h100", "--num-requests", "10", "--sensitivity"]) == 1
    assert "--sensitivity" in capsys.readouterr().err
    assert main(["simulate", "--num-requests", "10", "--sensitivity", "--find-max-rate", "--slo", "ttft_p99=1s"]) == 1
    assert "--find-max-rate" in capsys.readouterr().err


def test_simulate_command_with_tenants(tmp_path, capsys):
    """--tenants: a flooding tenant (10x) and a light one, all at once on a small engine: under vtc the
    light one's TTFT p99 is a fraction of fcfs's; the trace keeps each request's tenant."""
    p99 = {}
    for policy in ("fcfs", "vtc"):
        run_cli("simulate", "--num-requests", "220", "--tenants", "heavy:10,light:1", "--max-num-seqs", "8",
                "--tenant-fairness", policy, "--out", str(tmp_path / f"{policy}.json"), capsys=capsys)
        summary = json.loads((tmp_path / f"{policy}.json").read_text())["runs"][0]["summary"]
        assert set(summary["tenants"]) == {"heavy", "light"}
        assert 10 < summary["tenants"]["light"]["requests"] < 40
        p99[policy] = summary["tenants"]["light"]["p99_ttft_s"]
    assert p99["vtc"] < 0.3 * p99["fcfs"], p99
    wl = WorkloadSpec(num_requests=30, tenants={"a": 1, "b": 1}, seed=2).generate()
    save_trace(wl, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == wl and {r.tenant for r in wl} == {"a", "b"}


def test_simulated_adapters_respect_max_loras():
    """Requests over 6 adapters on an engine holding 2: never more than 2 adapters among the running
    (and simulate() takes the same limit)."""
    from conveyor.scheduler.config import SchedulerConfig
    from conveyor.scheduler.costs import StepCostModel
    from conveyor.sim.harness import drive
    from conveyor.sim.simulator import make_replica, simulate

    wl = WorkloadSpec(num_requests=60, adapters=6, seed=4).generate()
    assert {r.adapter for r in wl} == set(range(1, 7))
    rep = make_replica(SchedulerConfig(max_num_seqs=8), 512, 16, 0, StepCostModel(), False, False)
    rep.core.scheduler.max_loras = 2
    step, held = rep.core.step, []

    def checked_step():
        out = step()
        held.append(len({r.lora.lora_int_id for r in rep.core.scheduler.running if r.lora is not None}))
        return out

    rep.core.step = checked_step
    records = drive([rep], wl)
    assert all(r.finish is not None for r in records) and max(held) == 2
    result = simulate(wl, SchedulerConfig(max_num_seqs=8), num_blocks=512, max_loras=2)
    assert result.output_tokens == sum(r.num_output_tokens for r in records)
