"""`conveyor simulate --validate TRACE [--calibrate OUT]`: a step trace priced by a cost model finds
where the model is wrong, and the correction fitted on half of the trace removes the error on the
other half, between-steps time included. The "real" traces here come from the simulator run on a
known true cost (a kernel switch the profile missed, slower mixed steps, time between steps), so
the right answer is known exactly."""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import replace

import pytest

from conveyor.core.engine_core import EngineDeadError
from conveyor.core.trace import StepTracer
from conveyor.scheduler.config import SchedulerConfig
from conveyor.sim.cost import AfterPrefill, StepCostModel, StepShape
from conveyor.sim.simulator import SimRequest, simulate
from conveyor.sim.validate import (buckets_within, calibrate, gaps_between_steps, predicted, repeat_floor,
                                   runs_step_errors, speed_timeline, step_errors, token_buckets, traced_steps,
                                   validate)
from conveyor.sim.workload import WorkloadSpec

KNOTS = [1, 2, 4, 8, 9, 16, 64, 256, 1024]
PROFILE = StepCostModel(KNOTS, [0.010, 0.011, 0.013, 0.016, 0.020, 0.024, 0.040, 0.10, 0.40],
                        meta={"dispatch_thresholds": {"gemv_tokens": 8}})
# What the machine "really" does: steps of 9-64 decode tokens 45% / 20% slower than profiled (past
# the GEMV's width), steps carrying a prefill chunk 30% slower, 2 ms of front-end work between steps.
TRUTH = replace(PROFILE, decode_scales=[1, 1, 1, 1, 1.45, 1.45, 1.2, 1, 1], prefill_scales=[1.3] * len(KNOTS))
GAP = 0.002
CONFIG = SchedulerConfig(max_num_seqs=24, max_num_batched_tokens=256)


def workload(seed: int, rate: float = 20):
    return WorkloadSpec(num_requests=150, rate=rate, prompt_len="16:200", output_len="8:120", seed=seed).generate()


def real_trace(seed: int = 0, rate: float = 20) -> StepTracer:
    """A run on the true costs (the simulator waits GAP after each step, as a real trace shows it:
    `dt` is the step alone, the gap shows in the next step's start)."""
    res = simulate(workload(seed, rate), CONFIG, num_blocks=400, cost=replace(TRUTH, between_steps=GAP), trace=True,
                   seed=seed)
    return res.traces[0]


def bucket(report: dict, kind: str, tokens: str) -> dict:
    return next(r for r in report["buckets"] if (r["kind"], r["tokens"]) == (kind, tokens))


def test_buckets_split_at_the_kernel_switch():
    assert token_buckets(PROFILE)[:3] == [(1, 1), (2, 8), (9, 16)]
    assert token_buckets(replace(PROFILE, meta={}))[1] == (2, 8)   # no thresholds saved: the GEMV's default


def test_validation_finds_what_the_profile_missed():
    trace = real_trace()
    assert all(r.shape is not None for r in trace.records)
    exact = validate(trace, replace(TRUTH, between_steps=GAP))   # the true costs price their own run exactly
    assert all(abs(r["error"]) < 1e-9 for r in exact["buckets"]) and exact["all"]["steps"] > 300
    report = validate(trace, PROFILE)
    one, switch = bucket(report, "decode", "1"), bucket(report, "decode", "9-16")
    assert -0.25 < one["error"] < -0.05   # only the 2 ms between steps missing from ~10 ms steps
    assert switch["error"] < one["error"] - 0.15   # and past the switch, 45% of the step too
    assert bucket(report, "mixed", "17-64")["error"] < -0.2
    gap = report["between_steps"]
    assert gap["steps"] > 100 and gap["median_ms"] == pytest.approx(1e3 * GAP, rel=1e-6) and gap["model_ms"] == 0


def test_simulated_tokens_come_out_before_the_time_between_steps():
    cost = replace(PROFILE, between_steps=1.0)
    res = simulate([SimRequest(0.0, 10, 3)], CONFIG, num_blocks=40, cost=cost, trace=True)
    (record,) = res.records
    steps = res.traces[0].records
    assert len(steps) == 3 and all(r.dt < 0.1 for r in steps)
    assert record.ttft == pytest.approx(steps[0].dt)   # not a second later
    assert record.e2e == pytest.approx(sum(r.dt for r in steps) + 2 * 1.0)
    assert steps[1].t == pytest.approx(steps[0].t + steps[0].dt + 1.0)


def test_calibration_removes_the_error_on_held_out_steps():
    trace = real_trace()
    corrected, report = calibrate(trace, PROFILE)
    assert report["fit_steps"] > 50 and report["held_out_steps"] > 50
    before, after = report["before"], report["after"]
    assert max(abs(r["error"]) for r in before["buckets"]) > 0.2
    for r in after["buckets"]:   # every held-out bucket within 5% after (thin buckets lean on their neighbours)
        assert abs(r["error"]) < 0.05, r
    assert corrected.between_steps == pytest.approx(GAP, rel=1e-6)   # measured
    # past the largest step of the trace (24 decodes, 256-token budget) the profile stands
    assert corrected.decode_scales[-2:] == [1.0, 1.0] and corrected.prefill_scales[-1] == 1.0
    assert corrected.decode_scales[4] > 1.3 and min(corrected.prefill_scales[5:-1]) > 1.2
    assert corrected.meta["calibration"]["held_out_mean_abs_error_after"] < 0.03
    # The corrected model predicts the latencies of a run it was not fitted on; the profile does not.
    seed = 7
    real = simulate(workload(seed), CONFIG, num_blocks=400, cost=replace(TRUTH, between_steps=GAP), seed=seed)
    def worst_error(cost: StepCostModel) -> float:
        sim = simulate(workload(seed), CONFIG, num_blocks=400, cost=cost, seed=seed)
        return max(abs(sim.metric(m) / real.metric(m) - 1) for m in ("ttft_p50", "tpot_p50", "tpot_p90"))

    assert worst_error(corrected) < 0.015
    assert worst_error(replace(corrected, between_steps=0.0)) > 0.015   # the time between steps counts
    assert worst_error(PROFILE) > 0.15


def noisy(trace: StepTracer, sigma: float, seed: int = 0) -> StepTracer:
    """The trace with each step's time multiplied by a random factor of mean 1 (lognormal), the
    time after each step (to the next one's start) as it was."""
    rng = random.Random(seed)
    records, shift = [], 0.0
    for i, r in enumerate(trace.records):
        dt = r.dt * rng.lognormvariate(-sigma ** 2 / 2, sigma)
        records.append(replace(r, t=r.t + shift, dt=dt))
        shift += dt - r.dt
    return StepTracer(records=records, meta=trace.meta)


def test_calibration_keeps_the_total_time_of_noisy_steps():
    """A real machine's steps scatter around their mean (~10% per step here); the correction must
    price their total, which a queue feels, not a typical step: fitted relative to each measurement
    it came out ~2 sigma^2 low (-3% to -6% on the Zen4's traces; here -11% to -17% over six seeds, where
    the mean-ratio fit gives -1.6% to +3.4% on the held-out steps, within 1.6% on the whole trace)."""
    clean = real_trace()
    trace = noisy(clean, sigma=0.3)
    assert validate(trace, replace(TRUTH, between_steps=GAP))["all"]["mean_abs_error"] > 0.15   # really noisy
    assert abs(validate(trace, replace(TRUTH, between_steps=GAP))["all"]["error"]) < 0.03   # but of mean 1
    corrected, report = calibrate(trace, PROFILE)
    assert abs(report["after"]["all"]["error"]) < 0.06, report["after"]["all"]   # held out (223 steps)
    steps = traced_steps(trace)
    assert abs(sum(predicted(corrected, s) for s in steps) / sum(s.seconds for s in steps) - 1) < 0.04


def test_calibration_pools_several_traces(tmp_path, capsys):
    """A server's last few runs, pooled: each trace split into its own fit and held-out runs, every
    shape any of them ran corrected."""
    from conveyor.cli import main

    light, heavy = real_trace(seed=1, rate=0.5), real_trace(seed=2)
    assert max(s.shape.tokens for s in traced_steps(light) if s.kind == "decode") <= 8   # light: never past the GEMV
    alone, _ = calibrate(light, PROFILE)
    assert alone.decode_scales[4:6] == [1.0, 1.0]   # so alone it says nothing about the switch
    pooled, report = calibrate([light, heavy], PROFILE)
    assert report["fit_steps"] + report["held_out_steps"] == len(traced_steps(light)) + len(traced_steps(heavy))
    assert min(pooled.decode_scales[4:6]) > 1.3   # with the heavy run it finds it
    assert len(pooled.meta["calibration"]["trace"]) == 2
    assert validate([light, heavy], PROFILE)["all"]["steps"] == report["fit_steps"] + report["held_out_steps"]
    paths = [tmp_path / "light.json", tmp_path / "heavy.json"]
    light.save(paths[0])
    heavy.save(paths[1])
    PROFILE.save(tmp_path / "profile.json")
    assert main(["simulate", "--validate", *map(str, paths), "--cost-model", str(tmp_path / "profile.json"),
                 "--calibrate", str(tmp_path / "fixed.json")]) == 0
    assert capsys.readouterr().out.count("trace: ") == 2
    assert StepCostModel.load(tmp_path / "fixed.json").decode_scales == pytest.approx(pooled.decode_scales)


def test_a_corrected_profile_round_trips_and_refuses_bad_curves(tmp_path):
    corrected, _ = calibrate(real_trace(), PROFILE)
    corrected.save(tmp_path / "p.json")
    loaded = StepCostModel.load(tmp_path / "p.json")
    assert loaded.decode_scales == corrected.decode_scales and loaded.between_steps == corrected.between_steps
    with pytest.raises(ValueError, match="one factor per knot"):
        replace(PROFILE, decode_scales=[1.0, 2.0])


def test_gaps_count_only_while_the_engine_had_work():
    trace = real_trace(rate=0.5)   # light load: the engine waits for requests now and then
    idle = [i for i, r in enumerate(trace.records[:-1]) if r.running + r.waiting == 0]
    gaps = gaps_between_steps(trace)
    assert idle and len(gaps) == len(trace.records) - 1 - len(idle)
    assert max(gaps) == pytest.approx(GAP)   # those waits are not overhead


def test_a_trace_too_short_to_check_the_fit_is_refused():
    trace = real_trace()
    trace.records = trace.records[:12]
    with pytest.raises(ValueError, match="too short to calibrate"):
        calibrate(trace, PROFILE)


def test_validate_command(tmp_path, capsys):
    from conveyor.cli import main

    trace = real_trace()
    trace.save(tmp_path / "steps.json")
    PROFILE.save(tmp_path / "profile.json")
    assert main(["simulate", "--validate", str(tmp_path / "steps.json"), "--cost-model", str(tmp_path / "profile.json"),
                 "--out", str(tmp_path / "v.json")]) == 0
    out = capsys.readouterr().out
    assert "decode" in out and "9-16" in out and "between steps" in out
    assert "machine speed within the run" in out
    saved = json.loads((tmp_path / "v.json").read_text())
    assert saved["buckets"] and saved["speed_windows"]["windows"] > 1
    assert main(["simulate", "--validate", str(tmp_path / "steps.json"), "--cost-model", str(tmp_path / "profile.json"),
                 "--calibrate", str(tmp_path / "fixed.json")]) == 0
    assert "corrected" in capsys.readouterr().out
    assert StepCostModel.load(tmp_path / "fixed.json").decode_scales
    assert main(["simulate", "--calibrate", str(tmp_path / "x.json")]) != 0
    assert "--calibrate OUT goes with --validate" in capsys.readouterr().err


def test_profile_sustained_flag_does_not_swallow_the_model_path():
    from conveyor.cli import build_parser

    args = build_parser().parse_args(["profile", "--sustained", "some/model.gguf"])
    assert args.model == "some/model.gguf" and args.sustained and args.sustained_requests == 60
    assert build_parser().parse_args(["profile", "--sustained-requests", "30"]).sustained_requests == 30
    with pytest.raises(SystemExit):
        build_parser().parse_args(["profile", "--sustained", "--sustained-requests", "0"])
    # nor does --rescale; it scales by size unless --rescale-by median
    args = build_parser().parse_args(["profile", "--recheck", "--rescale", "some/model.gguf"])
    assert args.model == "some/model.gguf" and args.rescale and args.rescale_by == "size"
    args = build_parser().parse_args(["profile", "--recheck", "--rescale", "--rescale-by", "median"])
    assert args.rescale_by == "median"


def test_a_scaled_model_prices_every_step_and_copy_by_the_factor():
    """What a speed check applies: the machine `factor` times slower, for any shape, a trace-fitted
    correction and the time between steps included, and the original untouched."""
    corrected = replace(calibrate(real_trace(), PROFILE)[0], after_prefill_tokens=[16, 256],
                        after_prefill=[[0.001, 0.0005], [0.003, 0.002, 0.001]])
    scaled = corrected.scaled(1.25)
    trace = real_trace(rate=2.0)
    for record in trace.records:
        if record.shape is None:
            continue
        shape = StepShape(**{k: v for k, v in record.shape.items() if k in StepShape.__slots__})
        assert scaled.shape_time(shape) == pytest.approx(1.25 * corrected.shape_time(shape))
    assert scaled.swap_time(7) == pytest.approx(1.25 * corrected.swap_time(7))
    assert scaled.between_steps == pytest.approx(1.25 * corrected.between_steps) and corrected.between_steps > 0
    assert scaled.after_prefill_time(100, 1) == pytest.approx(1.25 * corrected.after_prefill_time(100, 1))
    assert corrected.after_prefill_time(100, 1) > 0
    assert scaled.decode_scales == corrected.decode_scales and scaled.knots == corrected.knots
    assert corrected.knot_costs == PROFILE.knot_costs and corrected.after_prefill[1][0] == 0.003   # a copy
    # the simulation of a slower machine: the same schedule, later
    fast = simulate(workload(3, 4.0), CONFIG, num_blocks=400, cost=corrected)
    slow = simulate(workload(3, 4.0), CONFIG, num_blocks=400, cost=corrected.scaled(1.25))
    assert slow.metric("tpot_p50") > fast.metric("tpot_p50")


def test_a_check_by_step_size_scales_the_curve_between_its_probes():
    """`scaled(factor, by_tokens)`: the step-cost curve takes each probe step's factor at its token count,
    interpolated between them and flat past them; every other term takes `factor`."""
    scaled = PROFILE.scaled(1.1, {1: 1.5, 8: 1.0, 256: 0.8})
    for tokens, f in ((1, 1.5), (8, 1.0), (256, 0.8), (1024, 0.8)):
        assert scaled.token_cost(tokens) == pytest.approx(f * PROFILE.token_cost(tokens))
    # between two probes the factor is the line between theirs at each knot
    k = next(k for k in PROFILE.knots if 8 < k < 256)
    assert scaled.token_cost(k) == pytest.approx((1.0 + (0.8 - 1.0) * (k - 8) / 248) * PROFILE.token_cost(k))
    assert scaled.decode_context == pytest.approx(1.1 * PROFILE.decode_context)
    assert scaled.swap_time(3) == pytest.approx(1.1 * PROFILE.swap_time(3))
    assert PROFILE.scaled(1.1, {}).knot_costs == pytest.approx([1.1 * c for c in PROFILE.knot_costs])
    # a decode step of one sequence takes the small steps' factor, not the median's
    small = StepShape(decode_tokens=1, decode_context=100, num_seqs=1, num_sampled=1)
    assert scaled.shape_time(small) > 1.3 * PROFILE.shape_time(small)


def test_runs_priced_by_their_own_models_pool_per_bucket():
    """A model scaled by the check before each run (sim_calibration's "checked"): each run's steps are
    priced by its own model, then pooled per bucket; one run alone is `step_errors`. The target on
    buckets counts only those of 20 steps or more."""
    a, b = traced_steps(real_trace(seed=1)), traced_steps(real_trace(seed=2))
    truth = replace(TRUTH, between_steps=GAP)
    alone = runs_step_errors([(a, PROFILE)])
    assert alone == step_errors(a, PROFILE)
    # run a priced exactly, run b at 1.3x: every bucket's error is b's share of the bucket's time x 0.3
    pooled = runs_step_errors([(a, truth), (b, truth.scaled(1.3))])
    assert pooled["all"]["steps"] == len(a) + len(b)
    for row in pooled["buckets"]:
        lo = int(row["tokens"].split("-")[0].rstrip("+"))
        hi = dict(token_buckets(PROFILE))[lo]
        in_a, in_b = ([s.seconds for s in run if s.kind == row["kind"] and lo <= s.shape.tokens <= hi]
                      for run in (a, b))
        assert row["steps"] == len(in_a) + len(in_b)
        assert row["error"] == pytest.approx(0.3 * sum(in_b) / (sum(in_a) + sum(in_b)), rel=1e-6)
    assert not buckets_within(pooled["buckets"])
    assert buckets_within(runs_step_errors([(a, truth), (b, truth)])["buckets"])
    small = [dict(r, error=0.5, steps=19) for r in alone["buckets"]]
    assert buckets_within(small) and not buckets_within(small, min_steps=19)


def test_profile_timing_runs_short_steps_for_a_minimum_time(monkeypatch):
    """A shape is run once to warm up, then `repeats` times, and more while less than `min_seconds`
    have passed (a clock that advances 125 ms per run here), never more than MAX_REPEATS."""
    import conveyor.profile as prof

    clock = [0.0]
    runs = []

    def step():
        runs.append(clock[0])
        clock[0] += 0.125   # binary fractions: exact sums

    monkeypatch.setattr(prof.time, "perf_counter", lambda: clock[0])
    assert prof._time(step, 3) == 0.125 and len(runs) == 1 + 3
    runs.clear()
    prof._time(step, 3, min_seconds=1.0)
    assert len(runs) == 1 + 8
    runs.clear()
    prof._time(step, 3, min_seconds=100.0)
    assert len(runs) == 1 + prof.MAX_REPEATS


# A machine whose decode steps pay for the weights a prefill chunk evicted from the caches: +4 ms on the
# first decode step after a 256-token chunk, then less each step (+1 ms after a 16-token chunk).
AFTER = dict(after_prefill_tokens=[16, 256], after_prefill=[[0.001, 0.0005], [0.004, 0.003, 0.002, 0.001]])


def test_decode_steps_after_a_prefill_chunk_pay_the_measured_transition():
    cost = replace(PROFILE, **AFTER)
    assert cost.after_prefill_time(256, 0) == 0.004 and cost.after_prefill_time(1000, 3) == 0.001   # flat past
    assert cost.after_prefill_time(136, 0) == pytest.approx(0.0025)   # halfway between the sizes
    assert cost.after_prefill_time(256, 4) == 0.0 and PROFILE.after_prefill_time(256, 0) == 0.0
    assert cost.after_prefill_time(256, -1) == 0.0   # not a decode step after a prefill (AfterPrefill.advance)
    # the state: decode-only steps counted from the last step that carried prefill tokens
    state = AfterPrefill()
    extras = [state.extra(cost, p, t) for p, t in [(0, 3), (256, 256), (0, 4), (0, 4), (16, 20), (0, 2), (0, 2),
                                                    (0, 2)]]
    assert extras == pytest.approx([0, 0, 0.004, 0.003, 0, 0.001, 0.0005, 0])
    with pytest.raises(ValueError, match="one curve per prefill size"):
        replace(PROFILE, after_prefill_tokens=[16])
    # In the simulator: the same schedule's decode steps run longer, by exactly those amounts.
    plain = simulate(workload(2, 4.0), CONFIG, num_blocks=400, cost=PROFILE, trace=True, seed=2)
    slow = simulate(workload(2, 4.0), CONFIG, num_blocks=400, cost=cost, trace=True, seed=2)
    assert slow.metric("tpot_p50") > plain.metric("tpot_p50")
    state, total = AfterPrefill(), 0.0
    for r in slow.traces[0].records:
        extra = state.extra(cost, r.shape["prefill_tokens"], r.prefill_tokens + r.decode_tokens)
        shape = StepShape(**{k: v for k, v in r.shape.items() if k in StepShape.__slots__})
        assert r.dt == pytest.approx(PROFILE.shape_time(shape) + extra)
        total += extra
    assert total > 0.05


def test_validation_prices_the_steps_after_a_prefill_chunk():
    """A trace of a machine with the transition: the true model (transition included) prices it exactly;
    without the transition the decode buckets come out short; the calibration keeps the profile's
    measured transition and fits the rest."""
    truth = replace(TRUTH, between_steps=GAP, **AFTER)
    trace = simulate(workload(0, 4.0), CONFIG, num_blocks=400, cost=truth, trace=True, seed=0).traces[0]
    exact = validate(trace, truth)
    assert all(abs(r["error"]) < 1e-9 for r in exact["buckets"])
    missing = replace(truth, after_prefill_tokens=[], after_prefill=[])
    steps = traced_steps(trace)
    first = [s for s in steps if s.since_prefill == 0]
    assert len(first) > 20 and all(s.kind == "decode" for s in first)
    for s in first:   # the first decode step after a chunk: short by the transition without it
        assert s.seconds - predicted(missing, s) == pytest.approx(truth.after_prefill_time(s.last_prefill, 0))
    assert all(predicted(missing, s) == pytest.approx(s.seconds) for s in steps if s.since_prefill < 0)
    corrected, report = calibrate(trace, replace(PROFILE, **AFTER))
    assert corrected.after_prefill == AFTER["after_prefill"]
    assert abs(report["after"]["all"]["error"]) < 0.02 < abs(report["before"]["all"]["error"])
    for r in report["after"]["buckets"]:
        if r["steps"] >= 10:
            assert abs(r["error"]) < 0.05, r


def test_a_constant_speed_is_the_cost_model_scaled():
    model = replace(TRUTH, between_steps=0.0)
    slow = simulate(workload(3), CONFIG, num_blocks=400, cost=model, seed=3, speed=lambda t: 1.7)
    scaled = simulate(workload(3), CONFIG, num_blocks=400, cost=model.scaled(1.7), seed=3)
    for m in ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "throughput"):
        assert slow.metric(m) == pytest.approx(scaled.metric(m), rel=1e-9)
    with pytest.raises(EngineDeadError, match="slowness factor must be positive"):   # as an engine's failing steps
        simulate(workload(3), CONFIG, num_blocks=400, cost=model, seed=3, speed=lambda t: 0.0)


def test_a_machine_that_slows_down_mid_run_is_replayed_by_its_speed_timeline():
    """A run near saturation on a machine that turns 1.4x slower from 10 s to 25 s: its trace's speed
    timeline finds the slow windows, and a simulation given that timeline reproduces the run's
    latency percentiles (within 4.4% here), which the same costs at their mean speed miss by up to 30%
    (the queue built in the slow stretch is the difference)."""
    seed = 5
    requests = workload(seed, rate=2.5)
    truth = replace(TRUTH, between_steps=GAP)

    def machine(t: float) -> float:
        return 1.4 if 10 <= t < 25 else 1.0

    real = simulate(requests, CONFIG, num_blocks=400, cost=truth, seed=seed, trace=True, speed=machine)
    trace = real.traces[0]
    timeline = speed_timeline(trace, truth, window=1.0, start=requests[0].arrival)
    assert timeline(5.5) == pytest.approx(1.0) and 1.3 < timeline(17.5) < 1.4   # steps slower, gaps not
    moves = validate(trace, truth)["speed_windows"]
    assert moves["max"] / moves["min"] > 1.25 and moves["windows"] > 20
    flat = validate(simulate(requests, CONFIG, num_blocks=400, cost=truth, seed=seed, trace=True).traces[0], truth)
    assert flat["speed_windows"]["max"] == pytest.approx(flat["speed_windows"]["min"])

    def worst(sim) -> float:
        return max(abs(sim.metric(m) / real.metric(m) - 1) for m in ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90"))

    assert worst(simulate(requests, CONFIG, num_blocks=400, cost=truth, seed=seed, speed=timeline)) < 0.07
    mean = statistics.fmean(timeline.factors)
    assert worst(simulate(requests, CONFIG, num_blocks=400, cost=truth.scaled(mean), seed=seed)) > 0.15


def test_the_cost_per_kv_token_read_follows_the_number_of_sequences_decoding(tmp_path):
    """One sequence reads its KV at a higher cost per token than many together (1.5x the slope of 32 on a
    Zen4 VM): with per-batch slopes a step's context term is interpolated between the measured batch
    sizes and flat past them; without them `decode_context` applies to every batch."""
    per = replace(PROFILE, decode_context=2e-6, context_batches=[1, 8, 32], context_slopes=[3e-6, 2e-6, 1.5e-6])

    def decoding(n: int, ctx: int) -> StepShape:
        return StepShape(decode_tokens=n, decode_context=n * ctx, num_seqs=n, num_sampled=n)

    base = replace(per, context_batches=[], context_slopes=[], decode_context=0.0)
    for n, slope in ((1, 3e-6), (8, 2e-6), (32, 1.5e-6), (64, 1.5e-6), (4, 3e-6 - 3 / 7 * 1e-6), (20, 1.75e-6)):
        s = decoding(n, 1000)
        assert per.context_slope(n) == pytest.approx(slope)
        assert per.shape_time(s) - base.shape_time(s) == pytest.approx(slope * n * 1000)
    shared = replace(per, context_batches=[], context_slopes=[])
    assert shared.shape_time(decoding(1, 1000)) - base.shape_time(decoding(1, 1000)) == pytest.approx(2e-3)
    prefill = StepShape(prefill_tokens=64, prefill_attention=2080, num_seqs=1, num_sampled=1)
    assert per.shape_time(prefill) == shared.shape_time(prefill)   # no decodes: no context term
    assert per.scaled(1.25).shape_time(decoding(3, 700)) == pytest.approx(1.25 * per.shape_time(decoding(3, 700)))
    # a check by step size scales each batch's slope by the factor at its token count (B sequences: B tokens)
    by_size = per.scaled(1.1, {1: 1.5, 8: 1.0, 256: 0.8})
    assert by_size.context_slopes == pytest.approx([1.5 * 3e-6, 1.0 * 2e-6, (1.0 - 0.2 * 24 / 248) * 1.5e-6])
    assert by_size.decode_context == pytest.approx(1.1 * 2e-6)
    per.save(tmp_path / "p.json")
    loaded = StepCostModel.load(tmp_path / "p.json")
    assert (loaded.context_batches, loaded.context_slopes) == (per.context_batches, per.context_slopes)
    with pytest.raises(ValueError, match="one slope per batch size"):
        replace(PROFILE, context_batches=[1, 8], context_slopes=[3e-6])


def test_the_profile_fit_finds_a_context_slope_per_batch_size():
    """`conveyor profile`'s fit, given steps from a machine whose cost per KV token falls with the batch,
    prices every measured shape exactly and finds each batch size's slope (one shared slope could not:
    the batch-1 steps it priced 5% high at 128 tokens of context and 9% low at 1024)."""
    from conveyor.profile import Sample, fit

    batches = [1, 2, 4, 8, 16, 32]
    slopes = [3.0e-6, 2.6e-6, 2.3e-6, 2.0e-6, 1.9e-6, 1.85e-6]
    shapes = [("decode", StepShape(decode_tokens=b, decode_context=b * (c + 1), num_seqs=b, num_sampled=b))
              for b in batches for c in (32, 128, 512, 1024)]
    shapes += [("prefill", StepShape(prefill_tokens=n, prefill_attention=n * (c + (n + 1) / 2), num_seqs=1,
                                     num_sampled=1, prefill_context=c)) for n in (16, 64, 256) for c in (0, 256, 1024)]
    shapes += [("mixed", StepShape(prefill_tokens=64, decode_tokens=8, decode_context=8 * 257,
                                   prefill_attention=64 * 32.5, num_seqs=9, num_sampled=9))]
    knots = sorted({s.tokens for _, s in shapes})
    truth = StepCostModel(knots, [0.004 + 0.0009 * k for k in knots], prefill_attention=8e-7, sampled=2e-4, seq=0.0,
                          context_batches=batches, context_slopes=slopes)
    model, quality = fit([Sample(kind, s, truth.shape_time(s)) for kind, s in shapes])
    assert model.context_batches == batches and model.context_slopes == pytest.approx(slopes, rel=1e-6)
    assert quality["mean_abs_rel_error"] < 1e-9 and quality["dropped"] == []
    for _, s in shapes:
        assert model.shape_time(s) == pytest.approx(truth.shape_time(s), rel=1e-6)
    assert model.decode_context == pytest.approx(statistics.median(slopes))



def test_a_profile_measured_with_n_threads_is_the_one_an_engine_of_n_threads_takes(tmp_path, monkeypatch, capsys):
    """`conveyor profile --torch-threads N` saves to ``<model>-<dtype>-<N>threads.json`` (one thread's steps
    cost 1.3-1.9x two threads' on a 2-vCPU VM), and an engine running N threads takes that profile before
    the plain one, which the others (and an engine of N threads without one of its own) keep taking."""
    import types

    import conveyor.engine.engine as engine_module
    import conveyor.profile as profile_module
    from conveyor.cli import main
    from conveyor.engine.engine import load_cost_model
    from conveyor.paths import profile_path

    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CONVEYOR_PROBES", "cache")   # the command sets it if unset: restored after the test
    plain, one = profile_path("m", "bfloat16"), profile_path("m", "bfloat16", 1)
    assert one == plain.with_name("m-bfloat16-1threads.json")
    assert load_cost_model("auto", "m", "bfloat16", 1) is None   # nothing saved yet
    replace(PROFILE, swap_block=0.5).save(plain)
    assert load_cost_model("auto", "m", "bfloat16", 1).swap_block == 0.5   # none of its own: the plain one
    # the CLI: the engine and the measurement stand-ins, the paths real
    monkeypatch.setattr(engine_module, "Engine", lambda config: types.SimpleNamespace(model_name="m", dtype="bfloat16"))
    measured = replace(PROFILE, swap_block=0.25, meta={"fit": {"samples": 1, "mean_abs_rel_error": 0.0,
                                                              "max_abs_rel_error": 0.0}})
    monkeypatch.setattr(profile_module, "profile", lambda engine, **kw: measured)
    assert main(["profile", "--torch-threads", "1"]) == 0
    assert f"saved {one}" in capsys.readouterr().out
    assert load_cost_model("auto", "m", "bfloat16", 1).swap_block == 0.25
    assert load_cost_model("auto", "m", "bfloat16", 2).swap_block == 0.5
    assert load_cost_model("auto", "m", "bfloat16").swap_block == 0.5
    assert load_cost_model("none", "m", "bfloat16", 1) is None
    assert load_cost_model(str(plain), "m", "bfloat16", 1).swap_block == 0.5   # a path given wins
    assert main(["profile"]) == 0 and f"saved {plain}" in capsys.readouterr().out


def test_the_repeat_floor_judges_an_exact_simulator_by_the_spread_of_two_real_runs():
    """repeat_floor: a real repeat 20% off on TPOT p50 misses the 15% target, but an
    exact simulator (off from one run by the difference / sqrt 2, 14%) would not; 30% off it would."""
    zero = dict.fromkeys(("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "throughput"), 0.0)
    report = repeat_floor([{**zero, "tpot_p50": 0.20}, {**zero, "tpot_p50": -0.30}, zero, zero])
    assert report["measured"] == {"missed_p50": 2, "missed_any": 2, "run_passes": pytest.approx(0.5 ** 4)}
    assert report["exact_simulator"]["missed_any"] == 1
    assert report["exact_simulator"]["run_passes"] == pytest.approx(0.75 ** 4)
    assert report["tpot_p50"]["median_abs"] == pytest.approx(0.10)
