"""The simulator runs the real scheduler to completion and its accounting adds up."""

from __future__ import annotations

import random

import pytest

from conveyor.scheduler.config import SchedulerConfig
from conveyor.sim.simulator import SimRequest, simulate


def workload(n=120, seed=0):
    rng = random.Random(seed)
    return [SimRequest(i * 0.05, rng.randint(8, 120), rng.choice([4, 8, 16, 200]), max_tokens=256)
            for i in range(n)]


@pytest.mark.parametrize("policy", ["optimistic", "conservative", "predictive"])
def test_simulation_completes_with_exact_token_counts(policy):
    wl = workload()
    res = simulate(wl, SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, admission_policy=policy),
                   num_blocks=48, block_size=16)
    assert res.output_tokens == sum(r.output_len for r in wl)
    assert len(res.e2e) == len(res.ttft) == len(wl)
    assert res.stats["kv_usage"] == 0.0 and res.stats["num_finished"] == len(wl)
    if policy == "conservative":
        assert res.stats["num_preemptions"] == 0


def test_optimistic_preempts_more_than_predictive():
    wl = workload(200, seed=1)
    runs = {p: simulate(wl, SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=256, admission_policy=p),
                        num_blocks=48) for p in ("optimistic", "predictive", "conservative")}
    pre = {p: r.stats["num_preemptions"] for p, r in runs.items()}
    assert pre["optimistic"] > pre["predictive"] >= pre["conservative"] == 0
