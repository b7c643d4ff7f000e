"""The simulator against the real engine (tiny model): a recorded run replayed with its measured timing
gives the same schedule step by step; the profiler fits the runner; step traces from the engine."""

from __future__ import annotations

import json

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.core.trace import StepTracer
from conveyor.profile import profile
from conveyor.sim.cost import StepCostModel
from conveyor.sim.harness import TOKEN_RANGE, run_on_engine
from conveyor.sim.simulator import replay
from conveyor.sim.validate import sustained_calibration, validate
from conveyor.sim.workload import WorkloadSpec

OPTIONS = dict(num_kv_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=32, preemption_mode="auto",
               admission_policy="optimistic", swap_space_gib=0.001, min_resident_steps=1, cost_model="none")


@pytest.mark.parametrize("seed", [1, 2])
def test_a_replayed_engine_run_schedules_identically(make_engine, seed):
    engine = make_engine(**OPTIONS)
    # Nearly a burst (the run is in real time): queueing, preemptions and prefix hits must not
    # depend on how fast this machine's steps are (at 300 req/s a fast one had no preemption).
    wl = WorkloadSpec(num_requests=30, rate=3000, prompt_len="3:30", output_len="2:20", prefix_groups=2,
                      prefix_len=8, prefix_share=0.5, priorities={0: 0.8, 1: 0.2}, seed=seed).generate()
    timeline: list[float] = []
    real, trace = run_on_engine(engine, wl, seed=seed, detail=True, timeline=timeline)
    s = engine.stats()
    assert s.num_preemptions > 0 and s.prefix_cache_hits > 0 and s.num_finished == 30
    vocab = engine.model_config.vocab_size
    sim, sim_trace = replay(timeline, wl, engine.config.scheduler, engine.kv.num_blocks, engine.config.block_size,
                            engine.kv.num_host_blocks, True, seed=seed,
                            token_range=(min(TOKEN_RANGE[0], vocab // 2), min(TOKEN_RANGE[1], vocab - 1)))
    assert len(sim_trace.records) == len(trace.records) > 30
    for a, b in zip(trace.records, sim_trace.records):
        assert (a.step, a.seqs, a.preempted, a.swapped_out, a.swapped_in) == \
            (b.step, b.seqs, b.preempted, b.swapped_out, b.swapped_in), f"step {a.step}"
    assert [r.num_output_tokens for r in real] == [r.num_output_tokens for r in sim] == [w.output_len for w in wl]


def test_a_profile_has_its_shapes_and_round_trips(make_engine, tmp_path):
    """On real timings the profile's shape is asserted, not how well its curve fits them: on a busy
    2-vCPU machine one quick sweep's fit error moved past 0.9 (benchmarks/profile_fit.py measures it)."""
    from conveyor.profile import step_shapes

    engine = make_engine(max_num_seqs=8)
    model = profile(engine, quick=True, repeats=1, passes=1, progress=False)
    fit = model.meta["fit"]
    assert fit["samples"] == len(step_shapes(engine, quick=True)) == len(model.meta["samples"])
    assert all(s["measured_s"] > 0 for s in model.meta["samples"]) and fit["mean_abs_rel_error"] >= 0
    assert all(c >= 0 for c in model.knot_costs) and sum(model.knot_costs) > 0   # the fit clips at zero
    assert model.swap_block > 0 and model.kv_bytes_per_token > 0
    path = tmp_path / "profile.json"
    model.save(path)
    loaded = StepCostModel.load(path)
    assert loaded.knots == model.knots and loaded.token_cost(3) == pytest.approx(model.token_cost(3))
    assert loaded.swap_block == model.swap_block and loaded.meta["fit"] == fit
    with pytest.raises(ValueError, match="not a step cost model"):
        (tmp_path / "bad.json").write_text('{"kind": "other"}')
        make_engine(cost_model=str(tmp_path / "bad.json"))


# A machine whose steps take exactly what this model prices them at, and whose swaps take SWAP_BLOCK
# seconds per block: linear in every term, so the profile's piecewise fit can represent it exactly.
TRUTH = StepCostModel([1, 4096], [2e-3 + 4e-5, 2e-3 + 4e-5 * 4096], decode_context=3e-8, prefill_attention=2e-9,
                      sampled=1e-4, seq=0.0)
SWAP_BLOCK = 5e-5


def profile_on_a_fake_clock(engine, monkeypatch) -> StepCostModel:
    """`conveyor profile` with its clock replaced: time passes only inside the runner's steps and swaps,
    by TRUTH's price of each (the steps still run, on the real model)."""
    import conveyor.profile as prof
    from conveyor.sim.cost import StepShape

    clock = [0.0]
    runner = engine.runner
    execute, swap = runner.execute, runner.swap

    def timed_execute(plan):
        clock[0] += TRUTH.shape_time(StepShape.of(plan))
        return execute(plan)

    def timed_swap(swap_out, swap_in):
        clock[0] += SWAP_BLOCK * (len(swap_out) + len(swap_in))
        return swap(swap_out, swap_in)

    monkeypatch.setattr(runner, "execute", timed_execute)
    monkeypatch.setattr(runner, "swap", timed_swap)
    monkeypatch.setattr(prof.time, "perf_counter", lambda: clock[0])
    return profile(engine, quick=True, repeats=1, passes=1, progress=False)


def test_a_profile_on_a_deterministic_clock_prices_every_step_as_the_machine_ran_it(make_engine, monkeypatch):
    model = profile_on_a_fake_clock(make_engine(max_num_seqs=8), monkeypatch)
    fit = model.meta["fit"]
    assert fit["mean_abs_rel_error"] < 1e-6 and fit["max_abs_rel_error"] < 1e-6
    for s in model.meta["samples"]:
        assert s["fitted_s"] == pytest.approx(s["measured_s"], rel=1e-6)
    assert model.swap_block == pytest.approx(SWAP_BLOCK, rel=1e-9)
    assert model.meta["engine_overhead_s"] == {"batch_1": 0.0, "batch_8": 0.0}   # no time outside the runner
    # the profile's own probe prices are the times the steps took
    assert model.meta["probe_fit"] == pytest.approx(model.meta["probe"], rel=1e-6)


@pytest.mark.parametrize("swap_block, mode", [(1e-9, "swap"), (1.0, "recompute")])
def test_a_profile_drives_auto_preemption_as_it_prices_it(make_engine, monkeypatch, tmp_path, swap_block, mode):
    """`preemption_mode auto` takes the cheaper way back for each victim, priced by the profile: the same
    profile with swaps nearly free preempts by swapping, with swaps dear by recomputing."""
    model = profile_on_a_fake_clock(make_engine(max_num_seqs=8), monkeypatch)
    model.swap_block = swap_block
    path = tmp_path / "profile.json"
    model.save(path)
    engine = make_engine(**{**OPTIONS, "cost_model": str(path)})
    costs = engine.scheduler.costs
    assert costs.swap(3) == pytest.approx(2 * 3 * swap_block)
    for n in (16, 300):   # the profile's step-cost curve, attention included
        assert costs.recompute(n) == pytest.approx(n * model.recompute_time_per_token(n))
    wl = WorkloadSpec(num_requests=30, rate=3000, prompt_len="3:30", output_len="2:20", seed=3).generate()
    run_on_engine(engine, wl, seed=3)
    s = engine.stats()
    assert s.num_finished == 30 and s.num_preemptions > 0
    if mode == "swap":
        assert s.num_swaps_out > 0 and s.num_swaps_in == s.num_swaps_out
    else:
        assert s.num_swaps_out == 0
    engine.kv.check_invariants(set())
    assert engine.kv.num_free_blocks == engine.kv.num_blocks   # every block back


def test_preemption_costs_without_a_profile_and_set_by_the_user(make_engine, tmp_path):
    model = StepCostModel([1, 64], [1e-3, 5e-3], swap_block=3e-5)
    path = tmp_path / "profile.json"
    model.save(path)
    default = make_engine(cost_model="none").scheduler.costs
    assert (default.swap(1), default.recompute(10)) == (2 * 2e-4, 10 * 1e-3)
    # costs the user set win over the profile
    mine = make_engine(cost_model=str(path), swap_cost_per_block=5e-3, recompute_cost_per_token=7e-3).scheduler.costs
    assert (mine.swap(1), mine.recompute(10)) == (pytest.approx(2 * 5e-3), pytest.approx(10 * 7e-3))


def test_the_engine_writes_a_step_trace(make_engine, tmp_path):
    path = tmp_path / "steps.json"
    llm = LLM(engine=make_engine(step_trace=str(path)))
    llm.generate([[1, 2, 3], list(range(40))], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    trace = StepTracer.load(path)
    assert trace.meta["source"] == "engine" and len(trace.records) == llm.stats().steps
    assert sum(r.decode_tokens for r in trace.records) + sum(r.prefill_tokens for r in trace.records) == 43 + 2 * 4
    assert trace.records[-1].kv_usage == 0.0 and all(r.dt > 0 for r in trace.records)
    # each step's shape, as the cost model prices it: `simulate --validate` reads these
    assert all(r.shape["prefill_tokens"] + r.shape["decode_tokens"] == r.prefill_tokens + r.decode_tokens
               and r.shape["num_seqs"] == r.num_seqs for r in trace.records)
    assert sum(r.shape["num_sampled"] for r in trace.records) == 2 * 5
    report = validate(trace, StepCostModel())
    assert sum(b["steps"] for b in report["buckets"]) == len(trace.records) - 1   # each step the next one followed
    events = json.loads((tmp_path / "steps.chrome.json").read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == len(trace.records)


def test_a_sustained_run_calibrates_the_profile(make_engine):
    """`conveyor profile --sustained`: a short run of mixed traffic through the real engine, its step
    trace fitted against the profile (half of the busy steps) and checked on the other half."""
    engine = make_engine(max_num_seqs=8)
    model = profile(engine, quick=True, repeats=1, progress=False)
    corrected, report = sustained_calibration(engine, model, requests=24)
    cal = corrected.meta["calibration"]
    assert cal["sustained"]["requests"] == 24 and cal["sustained"]["rate"] > 0
    assert report["fit_steps"] >= 16 and report["held_out_steps"] >= 16
    assert sum(b["steps"] for b in report["after"]["buckets"]) == report["held_out_steps"]
    assert len(corrected.decode_scales) == len(corrected.knots) and corrected.between_steps >= 0
    assert corrected.knot_costs == model.knot_costs and not model.decode_scales   # the profile itself untouched
    assert engine.stats().num_finished >= 24 and not engine.has_unfinished_requests()


def test_profile_measures_both_sides_of_each_kernel_switch(make_engine, caplog):
    """The runner reports where its kernel path changes (the GEMV's width), and the profile's decode
    sweep has a knot on each side of it, so no straight line is drawn across the switch; an engine
    loading a profile measured on other switches, or on other C++ kernels, warns."""
    from conveyor.model.cpu_kernels import cpu_kernels
    from conveyor.profile import dispatch_thresholds, step_shapes

    engine = make_engine(max_num_seqs=16)
    model = engine.runner.model
    if cpu_kernels("cpu", next(model.parameters()).dtype) is None:
        pytest.skip("C++ kernels not built here")
    if not dispatch_thresholds(engine):
        model.cpu_linears(packed=False, gemv_max=5)
    width = dispatch_thresholds(engine)["gemv_tokens"]
    assert dispatch_thresholds(engine).get("fused_decode_tokens") in (None, width)

    class Count:   # how many sequences each decode shape schedules
        def seq(self, computed, num_tokens):
            return num_tokens

    decodes = {len(build(Count())) for kind, build in step_shapes(engine, quick=True) if kind == "decode"}
    assert {width, width + 1} <= decodes
    measured = profile(engine, quick=True, repeats=1, progress=False)
    assert measured.meta["dispatch_thresholds"]["gemv_tokens"] == width
    assert {width, width + 1} <= set(measured.knots)
    # A saved profile measured on other kernel switches is flagged when an engine loads it.
    from conveyor.engine.engine import warn_if_profile_stale

    with caplog.at_level("WARNING", logger="conveyor.engine.engine"):
        warn_if_profile_stale(measured, model)
        assert not caplog.records
        # ... and one measured on other C++ kernels (their sources' digest), thresholds alike
        digest, measured.meta["kernels"] = measured.meta["kernels"], "0" * 16
        warn_if_profile_stale(measured, model)
        assert "other C++ kernels" in caplog.text
        measured.meta["kernels"] = digest
        caplog.clear()
        measured.meta["dispatch_thresholds"] = {**measured.meta["dispatch_thresholds"], "quant_dense_tokens_0": 15}
        warn_if_profile_stale(measured, model)
        assert "run `conveyor profile` again" in caplog.text
        # ... and one measured with another number of torch threads
        caplog.clear()
        measured.meta["dispatch_thresholds"] = dispatch_thresholds(engine)
        measured.meta["machine"]["threads"] = torch.get_num_threads() + 1
        warn_if_profile_stale(measured, model)
        assert f"{torch.get_num_threads() + 1} torch threads" in caplog.text
        assert f"`conveyor profile --torch-threads {torch.get_num_threads()}`" in caplog.text


def test_the_profiles_sequences_get_scattered_blocks_of_their_own(make_engine):
    """A serving engine's block tables are not one run of consecutive blocks once requests have come and
    gone, and reading scattered KV costs more than reading consecutive blocks (1.2-1.3x at 1,024 tokens of
    context on the Zen4 with one block per place): the profile's synthetic sequences get blocks of their
    own from runs of one prompt chunk's consecutive blocks (as the scheduler allocates a chunk's from its
    free queue) in a shuffled order."""
    from conveyor.profile import _Plans

    engine = make_engine(num_kv_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=8)
    chunk = engine.config.scheduler.prefill_chunk_cap // 4   # blocks of one prompt chunk: 16
    plans = _Plans(engine)
    runs = [plans.order[i:i + chunk] for i in range(0, 64, chunk)]
    assert all(r == list(range(r[0], r[0] + chunk)) and r[0] % chunk == 0 for r in runs)   # consecutive runs ...
    assert sorted(plans.order) == list(range(64)) and plans.order != list(range(64))        # ... shuffled
    seqs = [plans.seq(8, 1) for _ in range(4)]   # 9 tokens of 4 per block: 3 blocks each
    tables = [s.new_block_ids for s in seqs]
    flat = [b for t in tables for b in t]
    assert len(flat) == 12 and len(set(flat)) == 12 and all(0 <= b < 64 for b in flat)   # no block shared
    ones = _Plans(engine, run=1)   # every block on its own (benchmarks/kv_scatter.py's "scattered")
    single = [ones.seq(8, 1).new_block_ids for _ in range(4)]
    assert any(b != a + 1 for t in single for a, b in zip(t, t[1:]))
    assert _Plans(engine, scattered=False).seq(8, 1).new_block_ids == [0, 1, 2]   # the old tables, for A/B
    engine.runner.execute(plans.plan(seqs))   # the runner takes them
    again = _Plans(engine)
    assert [again.seq(8, 1).new_block_ids for _ in range(4)] == tables   # the same order every time (seeded)


def test_a_speed_check_compares_with_the_profiles_fit_where_it_has_one():
    """A check's reference per probe: the fit's price saved with the profile (``meta.probe_fit``), else
    (profiles saved before it) the fitted time of the profile's sample of the probe's shape, else the
    probe's own time when profiled."""
    from conveyor.profile import probe_reference

    probe = {"decode 1@128": 0.010, "decode 8@128": 0.030, "prefill 256@0": 0.400}
    samples = [{"kind": "decode", "tokens": 1, "decode_context": 129, "prefill_attention": 0, "fitted_s": 0.008},
               {"kind": "decode", "tokens": 8, "decode_context": 8 * 513, "prefill_attention": 0, "fitted_s": 0.05},
               {"kind": "prefill", "tokens": 256, "decode_context": 0, "prefill_attention": 256 * 257 / 2,
                "fitted_s": 0.5}]
    older = StepCostModel([1], [0.01], meta={"probe": probe, "samples": samples})
    # decode 8 was sampled at 512 tokens of context only: its probe time stands
    assert probe_reference(older) == {"decode 1@128": 0.008, "decode 8@128": 0.030, "prefill 256@0": 0.5}
    newer = StepCostModel([1], [0.01], meta={"probe": probe, "samples": samples,
                                             "probe_fit": {"decode 1@128": 0.009, "decode 8@128": 0.02,
                                                           "prefill 256@0": 0.45}})
    assert probe_reference(newer) == newer.meta["probe_fit"]
    # rescaled twice before probe_fit was saved: the model, not its samples, was multiplied by the factors
    rescaled = StepCostModel([1], [0.01], meta={"probe": probe, "samples": samples,
                                                "speed_checks": [{"factor": 1.5}, {"factor": 0.8}]})
    assert probe_reference(rescaled) == pytest.approx({"decode 1@128": 0.008 * 1.2, "decode 8@128": 0.030,
                                                       "prefill 256@0": 0.5 * 1.2})
    assert probe_reference(StepCostModel([1], [0.01], meta={"probe": probe})) == probe
    assert probe_reference(StepCostModel([1], [0.01])) == {}


def test_a_speed_check_times_the_profiles_probe_steps_again(make_engine, tmp_path):
    """`conveyor profile --recheck [--rescale]`: a profile keeps a few of its step shapes' times (its
    probe) and its fit's prices of them; a later check times them again and gives the machine's drift as
    their median ratio to the fit's prices (and each one's ratio by its token count); the rescaled profile
    prices every step by that factor and compares the next check with its own prices of the probes.
    A profile's sweeps (`passes`) give one sample per shape; it measures the decode steps after a chunk."""
    import statistics

    from conveyor.profile import AFTER_PREFILL_STEPS, recheck_profile, speed_check, step_shapes
    from conveyor.sim.cost import StepShape

    engine = make_engine(max_num_seqs=8)
    model = profile(engine, quick=True, repeats=1, passes=2, progress=False)
    assert model.meta["fit"]["samples"] == len(step_shapes(engine, quick=True))
    # the decode steps after a 64-token chunk, measured apart (on this tiny model the caches hardly care)
    assert model.after_prefill_tokens == [64] and len(model.after_prefill[0]) == AFTER_PREFILL_STEPS
    assert all(t >= 0 for t in model.after_prefill[0])
    probe, fit = model.meta["probe"], model.meta["probe_fit"]
    # (32 sequences exceed max_num_seqs)
    assert set(probe) == set(fit) == {"decode 1@128", "decode 8@128", "prefill 256@0"}
    assert all(t > 0 for t in [*probe.values(), *fit.values()])
    # the fit's price of a probe is the fit's price of the profile's sample of that shape (a 256-token chunk)
    chunk = [s for s in model.meta["samples"] if s["kind"] == "prefill" and s["tokens"] == 256
             and s["prefill_attention"] == 256 * 257 / 2]
    assert len(chunk) == 1 and fit["prefill 256@0"] == pytest.approx(chunk[0]["fitted_s"])
    path = tmp_path / "profile.json"
    model.save(path)
    check = recheck_profile(engine, path, rescale=True, by_size=False)   # --rescale-by median
    factor = check["factor"]
    assert check["then_s"] == fit and set(check["ratios"]) == set(probe)
    assert factor == pytest.approx(statistics.median(check["now_s"][k] / fit[k] for k in probe))
    assert check["by_tokens"] == {1: check["ratios"]["decode 1@128"], 8: check["ratios"]["decode 8@128"],
                                  256: check["ratios"]["prefill 256@0"]}
    saved = StepCostModel.load(path)
    shape = StepShape(prefill_tokens=40, decode_tokens=3, decode_context=300, prefill_attention=900, num_seqs=4,
                      num_sampled=4)
    assert saved.shape_time(shape) == pytest.approx(factor * model.shape_time(shape))
    assert saved.swap_time(5) == pytest.approx(factor * model.swap_time(5))
    assert saved.meta["probe"] == check["now_s"] and [c["factor"] for c in saved.meta["speed_checks"]] == [factor]
    assert saved.meta["probe_fit"] == pytest.approx({k: factor * t for k, t in fit.items()})
    again = recheck_profile(engine, path)   # against the rescaled profile's prices; without --rescale, nothing saved
    assert again["then_s"] == saved.meta["probe_fit"] and StepCostModel.load(path).knot_costs == saved.knot_costs
    # --rescale by-size: each probe's factor at its step size; the next references are the probes' prices
    # under that model, each scaled by a factor within the check's range (interpolated between probes)
    by = recheck_profile(engine, path, rescale=True)   # by size, as --rescale
    sized = StepCostModel.load(path)
    # a check of several rounds: each probe's time is its median over them, every round kept
    rounds = speed_check(engine, sized, rounds=3)
    assert len(rounds["rounds_s"]) == 3 and rounds["then_s"] == sized.meta["probe_fit"]
    assert rounds["now_s"] == {k: statistics.median(r[k] for r in rounds["rounds_s"]) for k in probe}
    assert sized.meta["speed_checks"][-1]["by_tokens"] == {str(n): f for n, f in by["by_tokens"].items()}   # JSON
    assert sized.token_cost(1) == pytest.approx(by["by_tokens"][1] * saved.token_cost(1))
    low, high = min(by["ratios"].values()), max(by["ratios"].values())
    for k, t in by["then_s"].items():
        assert low * (1 - 1e-9) <= sized.meta["probe_fit"][k] / t <= high * (1 + 1e-9)
    assert sized.meta["probe"] == by["now_s"]
    without = StepCostModel(model.knots, model.knot_costs, meta={k: v for k, v in model.meta.items() if k != "probe"})
    without.save(tmp_path / "old.json")
    with pytest.raises(ValueError, match="no probe times"):
        recheck_profile(engine, tmp_path / "old.json")
    with pytest.raises(ValueError, match="no profile at"):
        recheck_profile(engine, tmp_path / "missing.json")
