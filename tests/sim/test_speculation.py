"""Speculative decoding in the simulator: the real Speculator picks drafts by the cost model, the
executor accepts them as the workload's acceptance distribution draws, and every request still
ends at exactly its oracle length."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from conveyor.core.engine_core import EngineCore
from conveyor.kv.manager import KVCacheManager
from conveyor.runner.state import RunnerState
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler.config import SchedulerConfig
from conveyor.scheduler.output import ModelOutput, NewRequestData, ScheduledSeq, SchedulerOutput
from conveyor.scheduler.scheduler import Scheduler
from conveyor.sim.cli import main
from conveyor.sim.cost import StepCostModel, StepShape
from conveyor.sim.harness import EOS, OracleExecutor, OracleLengths, Replica, drive
from conveyor.sim.roofline import GPUS, MODEL_PRESETS, RooflineCostModel
from conveyor.sim.simulator import SimClock, SimRequest, simulate, step_shape
from conveyor.sim.speculation import SimProposer, SimSpeculation, make_speculator, parse_acceptance
from conveyor.spec.speculator import SpeculativeConfig, Speculator

SPEC = {"method": "ngram", "num_speculative_tokens": 5}
# per-token cost linear, no fixed part: an extra row costs as much as a decode, so drafts never pay
LINEAR = StepCostModel(knots=[1, 1024], knot_costs=[1e-3, 1.024])



def workload(n=120, seed=0):   # as test_simulator.py's
    rng = random.Random(seed)
    return [SimRequest(i * 0.05, rng.randint(8, 120), rng.choice([1, 2, 4, 8, 16, 200]), max_tokens=256)
            for i in range(n)]


def burst(n, seed=0, output="100:300", gap=0.0):
    """n requests at once (or one every `gap` seconds: alone, each finished before the next)."""
    lo, hi = map(int, output.split(":"))
    rng = random.Random(seed)
    return [SimRequest(i * gap, rng.randint(32, 128), rng.randint(lo, hi)) for i in range(n)]


def per_request_steps(res) -> int:
    """(request, step) pairs that sampled a token: what probes are counted against."""
    return res.output_tokens - res.spec["spec_accepted_tokens"]


@pytest.mark.parametrize("acceptance", [0.0, 0.6, 1.0])
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_every_request_ends_at_its_oracle_length_and_the_cache_is_whole(acceptance, preemption_mode):
    """Drafts accepted up to the request's end, EOS exactly at its oracle length, through chunked
    prefill and preemption (a small cache), with the runner's state in step with the scheduler's."""
    wl = workload()
    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, admission_policy="optimistic",
                          preemption_mode=preemption_mode)
    res = simulate(wl, cfg, num_blocks=48, block_size=16, num_host_blocks=64,
                   speculative={**SPEC, "adaptive": False}, speculation=SimSpeculation(acceptance, 0.8))
    assert [r.num_output_tokens for r in res.records] == [min(w.output_len, w.cap) for w in wl]
    assert all(r.finish_reason == "stop" for r in res.records)
    assert res.stats.kv_usage == 0.0 and res.stats.num_finished == len(wl)
    assert res.stats.num_free_kv_blocks == res.stats.num_kv_blocks
    assert res.stats.num_preemptions > 0
    s = res.spec
    assert s["spec_drafts"] > 0 and s["spec_draft_tokens"] >= s["spec_drafts"]
    if acceptance == 0.0:
        assert s["spec_accepted_tokens"] == 0
    else:
        assert s["spec_accepted_tokens"] > 0
    assert res.stats.spec_rejected_tokens == s["spec_draft_tokens"] - s["spec_accepted_tokens"]


def test_speculation_is_deterministic_for_a_seed():
    def run():
        res = simulate(workload(80, seed=3), SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
                       num_blocks=200, speculative=SPEC, speculation=SimSpeculation(0.7, 0.5, seed=1))
        return [(r.first_token, r.finish, r.num_output_tokens) for r in res.records], res.spec

    assert run() == run()


def test_the_oracle_keeps_only_the_drafts_before_the_end():
    """A request 3 tokens from its end that verifies 5 drafts the model all accepts: 2 are kept and
    EOS follows them, the runner's state moves on by the kept ones only."""
    oracle = OracleLengths()
    oracle.lengths["r"] = 5
    prompt = ScheduledSeq("r", [7] * 10, 0, [0], new=NewRequestData(SamplingParams(), 0, 0), sample=True)
    assert oracle.fix_output(SchedulerOutput(1, [prompt]), {"r": 9}) == ({"r": 9}, {})
    decode = ScheduledSeq("r", [9], 10, [], sample=True)
    assert oracle.fix_output(SchedulerOutput(2, [decode]), {"r": 9}) == ({"r": 9}, {})
    verify = ScheduledSeq("r", [9] + [3] * 5, 11, [], sample=True, num_drafts=5)
    sampled, accepted = oracle.fix_output(SchedulerOutput(3, [verify]), {"r": 9}, lambda rid, n, k: k)
    assert sampled == {"r": EOS} and accepted == {"r": 2}
    assert oracle.state.row("r").num_output_tokens == 4          # 2 known + 2 accepted (EOS is the 5th)
    assert oracle.state.requests["r"].num_computed_tokens == 11 + 1 + 2


class AcceptingRunner:
    """A runner that keeps its own RunnerState and accepts every draft (as a model that always agrees)."""

    def __init__(self):
        self.state = RunnerState()

    def swap(self, swap_out, swap_in):
        pass

    def execute(self, plan):
        self.state.apply(plan)
        accepted = {}
        for s in plan.scheduled:
            if s.num_drafts:
                accepted[s.request_id] = s.num_drafts
                self.state.accept(s.request_id, s.num_drafts)
        return ModelOutput({s.request_id: 7 for s in plan.scheduled if s.sample}, accepted=accepted or None)


def test_the_oracle_executor_ends_a_real_runners_requests_at_their_length():
    """run_on_engine's path: the runner accepts more drafts than fit before a request's end; the oracle
    keeps those that fit and ends the request there, and the runner (one step ahead) forgets it."""
    wl = [dataclasses.replace(w, arrival=0.0) for w in workload(60, seed=2)]   # (the runner takes no time)
    clock, oracle, runner = SimClock(), OracleLengths(), AcceptingRunner()
    kv = KVCacheManager(40, 16, 32, False)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, admission_policy="optimistic",
                                          preemption_mode="swap"), kv)
    scheduler.speculator = make_speculator(SpeculativeConfig.parse({**SPEC, "adaptive": False}),
                                           SimSpeculation(1.0), StepCostModel())
    core = EngineCore(scheduler, OracleExecutor(runner, oracle), clock)
    records = drive([Replica(core, oracle, clock, clock.wait_until)], wl)
    assert [r.num_output_tokens for r in records] == [w.output_len for w in wl]
    assert scheduler.speculator.stats.num_accepted_tokens > 0 and scheduler.stats.num_preemptions > 0
    assert kv.num_free_blocks == kv.num_blocks and not core.has_unfinished()


def test_acceptance_draws_a_truncated_geometric():
    spec = SimSpeculation(0.8, seed=2)
    counts = [spec.accepted(str(r), 0, 4) for r in range(20_000)]
    for j in range(4):   # P(exactly j) = a^j (1 - a); all 4: a^4
        assert counts.count(j) / len(counts) == pytest.approx(0.8 ** j * 0.2, abs=0.01)
    assert counts.count(4) / len(counts) == pytest.approx(0.8 ** 4, abs=0.01)
    assert spec.accepted("7", 30, 4) == spec.accepted("7", 30, 4)   # deterministic
    mix = SimSpeculation("0.9:1,0.1:3")
    rates = [mix.rate_of(str(r)) for r in range(4000)]
    assert rates.count(0.9) / len(rates) == pytest.approx(0.25, abs=0.03) and set(rates) == {0.9, 0.1}
    assert parse_acceptance("0.5") == ((0.5, 1.0),)
    with pytest.raises(ValueError):
        parse_acceptance("1.5")
    with pytest.raises(ValueError):
        SimSpeculation(0.5, match_rate=2)


def test_the_proposer_guesses_at_the_match_rate():
    class Req:   # what the proposer reads of a request
        def __init__(self, rid, n):
            self.request_id, self.num_output_tokens = rid, n

    p = SimProposer(SimSpeculation(0.5, match_rate=0.3))
    guesses = [p.propose(Req(str(r), r % 50), 4) for r in range(5000)]
    assert sum(bool(g) for g in guesses) / len(guesses) == pytest.approx(0.3, abs=0.03)
    assert all(g == [] or (len(g) == 4 and EOS not in g) for g in guesses)
    assert p.propose(Req("1", 0), 0) == []


def test_a_verification_is_priced_as_the_runner_runs_it():
    """k + 1 single-token decodes at consecutive positions (runner/inputs.py), not a prefill chunk."""
    verify = ScheduledSeq("a", [5, 6, 7], 100, [], sample=True, num_drafts=2)
    other = ScheduledSeq("b", [5], 50, [], sample=True)
    s = step_shape(SchedulerOutput(1, [verify, other]))
    assert s == StepShape(decode_tokens=4, decode_context=101 + 102 + 103 + 51, num_seqs=4, num_sampled=4)
    assert step_shape(SchedulerOutput(1, [other])) == StepShape.of(SchedulerOutput(1, [other]))


def test_at_batch_one_speculation_shortens_the_time_per_token():
    """The default CPU curve: a step of a few tokens costs about one of one token (the weights are
    read once), so drafts accepted 80% of the time cut TPOT."""
    wl = burst(6, gap=100.0)
    cfg = SchedulerConfig(max_num_seqs=1)
    base = simulate(wl, cfg, num_blocks=400)
    spec = simulate(wl, cfg, num_blocks=400, speculative=SPEC, speculation=SimSpeculation(0.8))
    assert spec.output_tokens == base.output_tokens
    assert spec.metric("tpot_mean") < 0.7 * base.metric("tpot_mean")
    assert spec.spec["spec_tokens_per_step"] > 1.6


def test_at_a_large_batch_with_a_linear_cost_speculation_does_not_cost_throughput():
    """64 decodes together, each row as dear as the next: an extra row (a draft) costs a decode's share
    and brings back 0.8 of one, so the speculator keeps its drafts to a few and throughput stays."""
    wl = burst(64)
    cfg = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048)
    base = simulate(wl, cfg, num_blocks=4000, cost=LINEAR)
    spec = simulate(wl, cfg, num_blocks=4000, cost=LINEAR, speculative=SPEC, speculation=SimSpeculation(0.8))
    assert spec.output_tokens == base.output_tokens
    assert spec.throughput > 0.97 * base.throughput


def test_at_a_large_batch_with_a_linear_cost_the_speculator_proposes_almost_nothing():
    wl = burst(64)
    cfg = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048)
    spec = simulate(wl, cfg, num_blocks=4000, cost=LINEAR, speculative=SPEC, speculation=SimSpeculation(0.8))
    # a single-draft probe per request every PROBE_EVERY steps, and a few before the rates are learned
    assert spec.spec["spec_draft_tokens"] < 1.25 * per_request_steps(spec) / Speculator.PROBE_EVERY


@pytest.mark.parametrize("batch", [1, 8])
def test_nothing_accepted_stops_the_speculation_but_for_probes(batch):
    wl = burst(batch, output="200:300")   # all in at once: no queue
    cfg = SchedulerConfig(max_num_seqs=batch)
    base = simulate(wl, cfg, num_blocks=2000)
    res = simulate(wl, cfg, num_blocks=2000, speculative=SPEC, speculation=SimSpeculation(0.0))
    s = res.spec
    assert s["spec_accepted_tokens"] == 0 and res.output_tokens == base.output_tokens
    # probes: one draft per request every PROBE_EVERY steps; a few more while its rate falls from the prior
    probes = per_request_steps(res) / Speculator.PROBE_EVERY
    assert s["spec_drafts"] < 1.2 * probes + 10 * len(wl)
    assert s["spec_draft_tokens"] < 1.2 * probes + 20 * len(wl)
    assert res.throughput > 0.95 * base.throughput


def test_the_roofline_model_prices_speculation_too():
    """An H200 with Llama-3.1-8B: at batch 1 a step is a read of the weights whatever its rows, so
    accepted drafts are nearly free tokens; the speculator learns this from the roofline's curve."""
    cost = RooflineCostModel(GPUS["h200"], MODEL_PRESETS["llama-3.1-8b"])
    wl = burst(4, output="100:200")
    cfg = SchedulerConfig(max_num_seqs=1)
    base = simulate(wl, cfg, num_blocks=4000, cost=cost)
    spec = simulate(wl, cfg, num_blocks=4000, cost=cost, speculative=SPEC, speculation=SimSpeculation(0.8))
    assert [r.num_output_tokens for r in spec.records] == [w.output_len for w in wl]
    assert spec.stats.kv_usage == 0.0
    assert spec.metric("tpot_mean") < 0.5 * base.metric("tpot_mean")
    assert spec.spec["spec_tokens_per_draft"] > 2.5


def test_the_cli_reports_the_spec_counters(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["--num-requests", "20", "--prompt-len", "32:64", "--output-len", "32:64", "--max-num-seqs", "2",
                 "--cost-model", "auto", "--speculative-config", json.dumps(SPEC), "--spec-acceptance", "0.7",
                 "--spec-match-rate", "0.9", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "speculation" in printed and "acceptance" in printed
    summary = json.loads(out.read_text())["runs"][0]["summary"]
    assert summary["spec_drafts"] > 0 and 0 < summary["spec_acceptance_rate"] <= 1
    assert summary["spec_tokens_per_step"] > 1
    with pytest.raises(ValueError):
        main(["--num-requests", "2", "--spec-acceptance", "0.7"])   # without --speculative-config


def test_the_cli_sweeps_speculation_on_and_off(capsys):
    assert main(["--num-requests", "10", "--prompt-len", "32", "--output-len", "64", "--max-num-seqs", "1",
                 "--sweep", 'speculative_config=none,{"method":"ngram","num_speculative_tokens":4}',
                 "--spec-acceptance", "0.8"]) == 0
    printed = capsys.readouterr().out
    assert "speculative_config=none" in printed and 'num_speculative_tokens":4}' in printed
