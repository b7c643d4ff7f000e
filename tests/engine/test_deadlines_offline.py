"""Queue deadlines offline (tiny model, real Engine): a prompt that waited past its max_queue_time comes
back failed with a clear error and the error code "queue_timeout", while the others are served."""

from __future__ import annotations

from conveyor import LLM
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler.deadlines import QUEUE_TIMEOUT


class Slow:
    """The engine's ModelRunner on a machine whose every forward pass takes `seconds`: the engine core's
    clock is replaced by one that advances only by that much per step, so which request outwaits its
    deadline depends on the schedule alone, never on how busy this machine is."""

    def __init__(self, engine, seconds: float):
        self.runner, self.seconds, self.now = engine.runner, seconds, 0.0
        engine.core.clock = engine.core.scheduler.clock = lambda: self.now
        engine.core.executor = self

    def swap(self, swap_out, swap_in) -> None:
        self.runner.swap(swap_out, swap_in)

    def execute(self, plan):
        self.now += self.seconds
        return self.runner.execute(plan)


def test_a_prompt_past_its_deadline_fails_clearly_and_the_others_are_served(make_engine):
    engine = make_engine(max_num_seqs=1)
    Slow(engine, 0.03)
    llm = LLM(engine=engine)
    first = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)   # >= 8 steps of 30 ms alone
    late = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, max_queue_time=0.1)
    patient = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([[5, 6, 7], [8, 9, 10], [11, 12]], [first, late, patient])
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length"]
    assert outs[1].error_code == QUEUE_TIMEOUT and outs[1].finished
    assert outs[1].error.startswith("queue timeout:") and "max_queue_time of 0.1 s" in outs[1].error
    assert outs[1].outputs[0].token_ids == [] and outs[0].error is None and outs[2].error is None
    s = llm.stats()
    assert s.num_queue_timeouts == 1 and s.kv_invariant_checks == 1 and s.kv_invariant_violations == 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_the_engine_option_caps_every_request(make_engine):
    engine = make_engine(max_num_seqs=1, max_queue_time=0.1)
    Slow(engine, 0.03)
    outs = LLM(engine=engine).generate([[5, 6, 7], [8, 9, 10]],
                                       SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                      max_queue_time=60.0))
    assert outs[0].error is None and outs[1].error_code == QUEUE_TIMEOUT
