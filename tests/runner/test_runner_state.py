"""RunnerState: a request's table and sampling state rebuilt from the plans' deltas (no torch)."""

from __future__ import annotations

import pytest

from conveyor.runner.state import RunnerState, StateError
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler.output import NewRequestData, ScheduledSeq, SchedulerOutput


def plan(*seqs: ScheduledSeq, forget: tuple[str, ...] = ()) -> SchedulerOutput:
    return SchedulerOutput(0, list(seqs), forget_ids=list(forget))


def new(rid: str, tokens: list[int], blocks: list[int], *, computed: int = 0, outputs: list[int] | None = None,
        sample: bool = True, **kw) -> ScheduledSeq:
    params = SamplingParams(temperature=0, **kw)
    history = list(outputs or []) if params.needs_penalties else None
    data = NewRequestData(params, 7, len(outputs or []), [1, 2] if params.repetition_penalty != 1.0 else None, history)
    return ScheduledSeq(rid, tokens, computed, blocks, data, sample=sample)


def delta(rid: str, tokens: list[int], computed: int, blocks: list[int] = (), sample: bool = True) -> ScheduledSeq:
    return ScheduledSeq(rid, tokens, computed, list(blocks), sample=sample)


def test_deltas_rebuild_the_table_and_the_output_history():
    state = RunnerState()
    state.apply(plan(new("a", [1, 2, 3, 4, 5], [7, 3], presence_penalty=0.5)))
    assert state.block_table("a") == [7, 3] and state.row("a").num_output_tokens == 0
    state.apply(plan(delta("a", [42], 5)))            # the token sampled last step comes back as the decode
    state.apply(plan(delta("a", [43], 6)))
    state.apply(plan(delta("a", [44], 7, [9])))       # position 8 opens a new block
    row = state.row("a")
    assert state.block_table("a") == [7, 3, 9]
    assert row.num_output_tokens == 3 and row.output_token_ids == [42, 43, 44] and row.seed == 7


def test_a_chunk_that_does_not_sample_adds_no_output():
    state = RunnerState()
    state.apply(plan(new("a", [1, 2, 3], [0], sample=False)))
    state.apply(plan(delta("a", [4, 5], 3, [1])))
    state.apply(plan(delta("a", [9], 5)))
    assert state.row("a").num_output_tokens == 1 and state.block_table("a") == [0, 1]


def test_new_data_is_copied_not_shared():
    outputs = [5, 6]
    seq = new("a", [1, 2, 3, 5, 6], [0, 1], outputs=outputs, frequency_penalty=1.0)
    state = RunnerState()
    state.apply(plan(seq))
    state.apply(plan(delta("a", [8], 5)))
    assert outputs == [5, 6] and seq.new.output_token_ids == [5, 6] and seq.new_block_ids == [0, 1]
    assert state.row("a").output_token_ids == [5, 6, 8] and state.row("a").num_output_tokens == 3


def test_forget_comes_before_the_plan_so_a_reused_id_starts_anew():
    state = RunnerState()
    state.apply(plan(new("a", [1, 2], [4])))
    state.apply(plan(new("a", [3, 4, 5], [8, 9]), forget=("a", "unknown")))
    assert state.block_table("a") == [8, 9] and state.requests["a"].num_computed_tokens == 3
    state.apply(plan(forget=("a",)))
    assert "a" not in state and len(state) == 0


def test_a_delta_that_does_not_follow_is_refused():
    state = RunnerState()
    with pytest.raises(StateError, match="does not hold"):
        state.apply(plan(delta("a", [1], 4)))
    state.apply(plan(new("a", [1, 2], [0])))
    with pytest.raises(StateError, match="expected 2"):
        state.apply(plan(delta("a", [3], 3)))


def test_a_request_swapped_back_in_keeps_its_state_and_takes_its_new_table():
    state = RunnerState()
    state.apply(plan(new("a", [1, 2, 3, 4, 5], [7, 3], presence_penalty=0.5)))
    swap_in = delta("a", [42], 5, [11, 12])
    swap_in.replace_table = True
    state.apply(plan(swap_in))
    row = state.row("a")
    assert state.block_table("a") == [11, 12] and row.output_token_ids == [42] and row.num_output_tokens == 1
