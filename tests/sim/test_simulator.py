"""The simulator runs the real scheduler to completion, deterministically, and its accounting adds up."""

from __future__ import annotations

import math
import random

import pytest

from conveyor.scheduler.config import SchedulerConfig
from conveyor.sim.cost import StepCostModel
from conveyor.sim.simulator import SimRequest, percentile, simulate
from conveyor.sim.workload import WorkloadSpec


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
    assert res.stats.kv_usage == 0.0 and res.stats.num_finished == len(wl)
    if policy == "conservative":
        assert res.stats.num_preemptions == 0


def test_optimistic_preempts_more_than_predictive():
    wl = workload(200, seed=1)
    runs = {p: simulate(wl, SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=256, admission_policy=p),
                        num_blocks=48) for p in ("optimistic", "predictive", "conservative")}
    pre = {p: r.stats.num_preemptions for p, r in runs.items()}
    assert pre["optimistic"] > pre["predictive"] >= pre["conservative"] == 0


def test_the_simulator_is_deterministic_for_a_seed():
    spec = WorkloadSpec(num_requests=150, rate=4.0, prompt_len="8:200", output_len="lognormal:40:1:300",
                        prefix_groups=3, prefix_len=32, prefix_share=0.5, priorities={0: 0.8, 1: 0.2}, seed=5)
    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, admission_policy="optimistic",
                          preemption_mode="auto")

    def run():
        res = simulate(spec.generate(), cfg, num_blocks=40, num_host_blocks=16, prefix_caching=True, trace=True)
        stats = res.stats.replace(last_step_time=0.0)   # wall time of the last step
        return [(r.first_token, r.finish, r.num_output_tokens, r.num_preemptions) for r in res.records], stats

    a, b = run(), run()
    assert a == b
    assert a[1].num_preemptions > 0 and a[1].prefix_cache_hits > 0


def test_replicas_share_the_load_and_answer_every_request_once():
    spec = WorkloadSpec(num_requests=200, rate=6.0, prompt_len="32:256", output_len="16:128", seed=2)
    cfg = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512)
    one = simulate(spec.generate(), cfg, num_blocks=300)
    for router in ("least-loaded", "round-robin"):
        two = simulate(spec.generate(), cfg, num_blocks=300, replicas=2, router=router)
        assert len(two.finished) == 200 and two.output_tokens == one.output_tokens
        assert {r.replica for r in two.records} == {0, 1}
        assert two.metric("ttft_p50") < one.metric("ttft_p50") and two.metric("e2e_p90") < one.metric("e2e_p90")


def test_swaps_cost_modelled_time():
    """The same preempting workload: swap copies take time in the simulated clock, recompute does not copy."""
    wl = WorkloadSpec(num_requests=60, prompt_len="64:128", output_len="64:200", seed=3).generate()
    # victims by arrival, so that the two runs preempt the same requests (by cost, the victim
    # order would follow the swap cost being compared)
    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, admission_policy="optimistic",
                          preemption_mode="swap", min_resident_steps=1, victim_policy="latest")
    fast = simulate(wl, cfg, num_blocks=48, num_host_blocks=200, cost=StepCostModel(swap_block=0.0))
    slow = simulate(wl, cfg, num_blocks=48, num_host_blocks=200, cost=StepCostModel(swap_block=0.01))
    assert fast.stats.num_swaps_out > 0 and fast.stats.num_swaps_out == slow.stats.num_swaps_out
    assert slow.sim_time > fast.sim_time + 0.01 * fast.stats.num_swaps_out


def test_slo_metrics_and_goodput():
    wl = WorkloadSpec(num_requests=100, rate=2.0, seed=4).generate()
    res = simulate(wl, SchedulerConfig(), num_blocks=500)
    assert res.metric("ttft_p50") <= res.metric("ttft_p99") <= max(res.ttft)
    assert res.meets({"ttft_p99": max(res.ttft)}) and not res.meets({"ttft_p99": min(res.ttft) / 2})
    assert res.goodput({"ttft_p99": math.inf}) == pytest.approx(100 / res.sim_time)
    assert res.goodput({"ttft_p99": 0.0}) == 0.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5


def test_elasticity_is_one_alone_and_grows_with_the_queue():
    """Requests that never meet scale with the step cost (elasticity 1: every time is a sum of step
    times); near saturation the queue multiplies it: arrivals keep their times while service slows."""
    from conveyor.sim.simulator import SENSITIVITY_METRICS, elasticity, saturation_rate

    cfg = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512)
    cost = StepCostModel()
    knobs = dict(config=cfg, num_blocks=2000, block_size=16)

    def metrics_at(spec):
        return lambda c: {m: simulate(spec.generate(), cost=c, seed=spec.seed, **knobs).metric(m)
                          for m in SENSITIVITY_METRICS}

    alone = WorkloadSpec(num_requests=40, rate=0.05, prompt_len="32:256", output_len="16:64", seed=3)
    e = elasticity(metrics_at(alone), cost)
    assert e["ttft_p50"] == pytest.approx(1.0, abs=1e-6) and e["tpot_p50"] == pytest.approx(1.0, abs=1e-6)
    assert abs(e["throughput"]) < 0.05   # pinned by the arrivals
    saturation = saturation_rate(WorkloadSpec(num_requests=200, prompt_len="32:256", output_len="16:128",
                                              seed=100).generate(), cost, **knobs)
    busy = WorkloadSpec(num_requests=300, rate=0.85 * saturation, prompt_len="32:256", output_len="16:128", seed=3)
    e = elasticity(metrics_at(busy), cost)
    assert e["ttft_p90"] > 1.5 and e["tpot_p90"] > 1.5, e


def test_a_cost_model_scaled_twice_as_slow_doubles_a_lone_requests_times():
    """What elasticity moves: every term of the cost model (steps, context, sampling, swaps, between
    steps) by one factor, so a model twice as slow gives twice the time of a lone request."""
    cost = StepCostModel()
    spec = WorkloadSpec(num_requests=5, rate=0.01, prompt_len="64", output_len="8", seed=1)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256)
    runs = [simulate(spec.generate(), cfg, num_blocks=100, cost=c) for c in (cost, cost.scaled(2.0))]
    assert runs[1].metric("ttft_p50") == pytest.approx(2 * runs[0].metric("ttft_p50"))
    assert runs[1].metric("tpot_p50") == pytest.approx(2 * runs[0].metric("tpot_p50"))
