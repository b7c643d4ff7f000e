"""Faults and bad input offline: a failing step fails only its requests; bad input raises and queues nothing.

A tiny random model behind the real Engine; faults are injected around the real ModelRunner.
"""

from __future__ import annotations

import pytest
import torch

from conveyor import LLM
from conveyor.core.engine_core import EngineDeadError
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler.output import ModelOutput, SchedulerOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [21, 22, 23, 24, 25, 26, 27], [31, 32]]


class Injected(RuntimeError):
    pass


class Flaky:
    """The engine's ModelRunner, raising `error` in `phase` ("execute" or "swap") at the given calls."""

    def __init__(self, runner, fail_calls: set[int], phase: str = "execute", error: type[BaseException] = Injected):
        self.runner, self.fail_calls, self.phase, self.error = runner, fail_calls, phase, error
        self.calls = {"execute": 0, "swap": 0}
        self.failed_plans: list[SchedulerOutput] = []

    def _maybe_fail(self, phase: str) -> None:
        self.calls[phase] += 1
        if phase == self.phase and self.calls[phase] in self.fail_calls:
            raise self.error(f"injected {phase} failure")

    def swap(self, swap_out, swap_in) -> None:
        self._maybe_fail("swap")
        self.runner.swap(swap_out, swap_in)

    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        try:
            self._maybe_fail("execute")
        except BaseException:
            self.failed_plans.append(plan)
            raise
        return self.runner.execute(plan)


def drain(engine) -> dict:
    outs = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            return outs
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        engine.kv.check_invariants()
    raise AssertionError("engine did not finish")


@pytest.fixture(scope="module")
def reference(make_engine):
    engine = make_engine()
    return [LLM.from_engine(engine).generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


def assert_idle(engine) -> None:
    s = engine.stats()
    assert s.num_running == s.num_waiting == s.num_swapped == 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert engine.kv.num_free_host_blocks == engine.kv.num_host_blocks
    assert not engine.has_unfinished_requests()


def test_forward_failure_fails_only_its_step(make_engine, reference):
    engine = make_engine(max_num_seqs=2)   # two run, two wait
    flaky = Flaky(engine.runner, {3})
    engine.core.executor = flaky
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    outs = drain(engine)
    (plan,) = flaky.failed_plans
    failed = {i for i in ids if outs[i].error}
    assert len(failed) == len(plan.scheduled) == 2
    for i, rid in enumerate(ids):
        o = outs[rid]
        if rid in failed:
            assert o.finished and o.outputs[0].finish_reason == "error" and "injected execute failure" in o.error
        else:   # not in the failed step: untouched
            assert o.error is None and o.outputs[0].token_ids == reference[i]
    s = engine.stats()
    assert s.step_failures == 1 and s.consecutive_step_failures == 0 and not engine.dead
    assert s.num_errors == 2
    assert_idle(engine)
    # the engine goes on serving, with the same answers
    again = LLM.from_engine(engine).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == reference


def test_sampling_failure_fails_its_step(make_engine, reference):
    engine = make_engine()
    sampler, calls = engine.runner.sampler, []

    def failing_once(logits, rows):
        calls.append(len(rows))
        if len(calls) == 2:
            raise Injected("injected sampling failure")
        return sampler(logits, rows)

    engine.runner.sampler = failing_once
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS[:2]]
    outs = drain(engine)
    assert all("injected sampling failure" in outs[i].error for i in ids)
    assert_idle(engine)
    engine.runner.sampler = sampler
    assert LLM.from_engine(engine).generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids == reference[0]


def test_nan_logits_fail_the_step_with_a_clear_error(make_engine, reference):
    engine = make_engine()
    model, forward, steps = engine.runner.model, engine.runner.model.forward, []

    def nan_once(*args, **kwargs):
        steps.append(1)
        logits = forward(*args, **kwargs)
        return torch.full_like(logits, float("nan")) if len(steps) == 3 else logits

    model.forward = nan_once
    try:
        rid = engine.add_request(PROMPTS[0], GREEDY)
        out = drain(engine)[rid]
    finally:
        del model.forward
    assert out.outputs[0].finish_reason == "error" and "non-finite logits" in out.error
    assert_idle(engine)
    assert LLM.from_engine(engine).generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids == reference[0]


def test_swap_failure_fails_the_victims_and_the_step(make_engine, reference):
    # 8 blocks of 4 tokens cannot hold 3 running requests of up to 7 + 12 tokens: swap preemption.
    engine = make_engine(num_kv_blocks=8, block_size=4, preemption_mode="swap", admission_policy="optimistic",
                         min_resident_steps=1, max_num_seqs=3)
    flaky = Flaky(engine.runner, {1}, phase="swap")
    engine.core.executor = flaky
    prompts = PROMPTS * 3
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    outs = drain(engine)
    assert flaky.calls["swap"] >= 2   # swaps went on after the failed one
    failed = [i for i in ids if outs[i].error]
    assert 0 < len(failed) < len(ids) and all("injected swap failure" in outs[i].error for i in failed)
    for i, rid in enumerate(ids):
        if rid not in failed:
            assert outs[rid].outputs[0].token_ids == reference[i % len(PROMPTS)]
    assert engine.stats().step_failures == 1
    assert_idle(engine)


def test_repeated_failures_kill_the_engine(make_engine):
    engine = make_engine(max_num_seqs=1)
    engine.core.executor = Flaky(engine.runner, set(range(1, 100)))
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    outs = drain(engine)
    limit = engine.config.max_consecutive_step_failures
    assert limit == 3 and engine.dead and all(outs[i].error for i in ids)
    # one request per step: 3 failed in their own steps, the 4th was failed when the engine stopped
    assert engine.stats().step_failures == limit
    assert "the engine stopped" in outs[ids[-1]].error
    assert "consecutive steps failed" in engine.core.dead_reason
    assert_idle(engine)
    with pytest.raises(EngineDeadError):
        engine.add_request(PROMPTS[0], GREEDY)
    assert not engine.has_unfinished_requests()


# ---- offline bad input: ValueError, nothing queued, the next call works ------------------------------

@pytest.mark.parametrize("prompt", [
    {"prompt_token_ids": ["a"]}, {"prompt_token_ids": [1.0, 2.0]}, {"prompt_token_ids": [True]},
    {"prompt_token_ids": "123"}, {"prompt_token_ids": [1, 2], "prompt": 5}, {"text": "hi"}, 42, None,
    [[1, 2], "x", 3.5], "ab\ud800cd", [-1], [10 ** 9], [],
])
def test_bad_prompt_raises_and_queues_nothing(make_engine, reference, prompt):
    llm = LLM.from_engine(make_engine())
    with pytest.raises(ValueError):
        llm.generate([PROMPTS[0], prompt], GREEDY, use_tqdm=False)
    assert_idle(llm.engine)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference


@pytest.mark.parametrize("priority", [[0], [0, 1, 2], [0, "high"], [0, 1.5], 3, "ab", [0, None]])
def test_bad_priority_raises_and_queues_nothing(make_engine, reference, priority):
    llm = LLM.from_engine(make_engine())
    with pytest.raises(ValueError, match="priorit"):
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, priority=priority)
    assert_idle(llm.engine)
    assert llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, priority=[1, 0])[1].outputs[0].token_ids == reference[1]


@pytest.mark.parametrize("error", [KeyboardInterrupt, Injected])
def test_interrupted_generate_leaves_nothing_queued(make_engine, reference, error):
    """An exception escaping generate() (Ctrl-C in a step, an engine death) aborts all its requests."""
    engine = make_engine(max_num_seqs=2, max_consecutive_step_failures=1)
    flaky = Flaky(engine.runner, {3}, error=error)
    engine.core.executor = flaky
    llm = LLM.from_engine(engine)
    with pytest.raises(error if error is KeyboardInterrupt else EngineDeadError):
        out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        if error is Injected:   # one failure kills this engine: outputs with errors, then dead
            assert all(o.error for o in out) and engine.dead
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_idle(engine)
    if error is KeyboardInterrupt:
        engine.core.executor = flaky.runner
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference


def test_sampling_parameter_ranges_keep_arithmetic_finite(make_engine, reference):
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=1e-39)
    llm = LLM.from_engine(make_engine())
    # top_p so small that top_p * mass underflows to 0 in fp32 still keeps the most likely token
    tiny = SamplingParams(temperature=1.0, top_p=1e-50, seed=1, max_tokens=12, ignore_eos=True)
    assert llm.generate(PROMPTS[0], tiny)[0].outputs[0].token_ids == reference[0]
