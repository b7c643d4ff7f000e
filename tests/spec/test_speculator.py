"""The speculator's per-step choice of drafts: by the step-cost curve and each request's acceptance
rate -- all of a cheap draft at batch 1, none when an extra row costs what it may earn, and only rare
(backing-off) probes for a request whose drafts are refused."""

from __future__ import annotations

import pytest

from conveyor.request import Request
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler.costs import StepCostModel
from conveyor.spec.speculator import SpeculativeConfig, Speculator, StepTimes

# A request whose tokens repeat: the n-gram proposer always has a continuation to offer.
REPEATING = [1, 2, 3, 4, 5, 6, 7, 8] * 4 + [1, 2, 3]

FLAT = StepCostModel(knots=[1, 8, 64], knot_costs=[0.010, 0.011, 0.060])     # memory-bound: rows nearly free
LINEAR = StepCostModel(knots=[1, 1024], knot_costs=[0.001, 1.024])          # compute-bound: 1 ms per token


def requests(n: int) -> list[Request]:
    return [Request(f"r{i}", list(REPEATING), SamplingParams(max_tokens=100)) for i in range(n)]


def speculator(cost: StepCostModel, **options) -> Speculator:
    return Speculator(SpeculativeConfig(**{"num_speculative_tokens": 5, **options}), cost)


def test_batch_one_on_a_flat_curve_drafts_everything_it_can():
    spec = speculator(FLAT)
    spec.rate = 0.9
    (req,) = requests(1)
    assert spec.drafts([req], 0, budget=100) == {"r0": [4, 5, 6, 7, 8]}


def test_a_compute_bound_batch_drafts_nothing():
    spec = speculator(LINEAR)
    spec.rate = 0.8   # a draft earns 0.8 tokens at most, and costs a whole token's time
    assert spec.drafts(requests(64), 0, budget=1000) == {}


def test_the_budget_and_the_output_limit_bound_the_drafts():
    spec = speculator(FLAT)
    spec.rate = 0.9
    reqs = requests(3)
    drafts = spec.drafts(reqs, 0, budget=4)
    assert sum(map(len, drafts.values())) <= 4
    short = Request("s", list(REPEATING), SamplingParams(max_tokens=3))   # two tokens left before its last
    assert spec.drafts([short], 0, budget=100) == {"s": [4, 5]}


def test_refused_drafts_leave_only_backing_off_probes():
    spec = speculator(FLAT)
    (req,) = requests(1)
    drafted = []
    for _ in range(400):
        d = spec.drafts([req], 0, budget=100).get("r0", [])
        drafted.append(len(d))
        if d:
            spec.observe("r0", len(d), 0)
    # at first it tries (the prior), then only probes: after 16, 32, 64, 128, 256 steps
    assert sum(1 for n in drafted[50:] if n) <= 5
    assert max(drafted[50:]) <= 1


def test_other_work_in_the_step_counts():
    """With a long prefill chunk in the step, drafts are weighed against all its work: on a linear
    curve they never pay, however few the decodes."""
    spec = speculator(LINEAR)
    spec.rate = 0.8
    assert spec.drafts(requests(2), 200, budget=100) == {}


def test_step_times_are_a_line_through_what_was_measured():
    times = StepTimes(LINEAR, stale=4)
    assert times(8) == pytest.approx(0.008)   # nothing measured: the cost model's curve
    times.observe(4, 0.010)
    assert times(8) == pytest.approx(0.020)   # one point: the curve through it
    times.observe(8, 0.014)
    assert times(6) == pytest.approx(0.012)   # between the points
    assert times(12) == pytest.approx(0.021)  # past them: from the last, along the cost model's curve
    times.observe(16, 0.100)                  # an expensive size...
    for _ in range(5):
        times.observe(8, 0.014)
    assert times(16) == pytest.approx(0.100)
    # ...measured 5 steps ago (stale): priced against a step of 8, only what is fresh counts
    assert times(16, against=8) == pytest.approx(0.028)


def test_config_parse_and_errors():
    assert SpeculativeConfig.parse('{"method": "suffix", "num_speculative_tokens": 3}').method == "suffix"
    assert SpeculativeConfig.parse(None) is None
    with pytest.raises(ValueError, match="expected one of"):
        SpeculativeConfig.parse({"method": "eagle"})
    with pytest.raises(ValueError, match="unknown speculative config key"):
        SpeculativeConfig.parse({"num_spec_tokens": 3})
    with pytest.raises(ValueError, match="not JSON"):
        SpeculativeConfig.parse("{method: ngram}")


def test_the_guard_leaves_speculation_off_where_it_measures_slower():
    """Whatever the cost model says, decode steps that speculated and measured more seconds per
    generated token than steps that did not soon stop: the other arm runs one step in EXPLORE_EVERY."""
    spec = speculator(FLAT)
    spec.rate = 0.9   # the model would draft all it can
    (req,) = requests(1)
    on_steps = 0
    for _ in range(200):
        drafted = bool(spec.drafts([req], 0, budget=100))
        on = spec._step_arm[1]
        on_steps += on
        assert drafted <= on
        spec.observe_step(1 + 5 * drafted, 0.020 if on else 0.010, 1)   # speculating: twice as slow a token
    assert on_steps <= 5 + spec.EXPLORE_STEPS * 3   # explorations after 20, 40, 80 ... steps
    # and the other way round: where speculating measures faster, it stays on
    spec = speculator(FLAT)
    spec.rate = 0.9
    on_steps = 0
    for _ in range(200):
        spec.drafts([req], 0, budget=100)
        on = spec._step_arm[1]
        on_steps += on
        spec.observe_step(6 if on else 1, 0.012 if on else 0.010, 4 if on else 1)
    assert on_steps >= 200 - 5 - spec.EXPLORE_STEPS * 3
