"""The scheduler -> runner seam carries what changed: a request the runner does not hold comes in
full once, a running one as a delta (new block ids, this step's tokens), and the ids the runner
must drop come in ``forget_ids``. The fake executor of ``Sim`` rebuilds every table from the
deltas with the runner's own ``RunnerState`` and checks it against the KV manager's after every
plan; these tests add the cases that matter most: plan size independent of context length,
preemption (recompute and swap), abort, a finish while nothing runs, and a reused request id."""

from __future__ import annotations

import pickle

import pytest

from conveyor.request import RequestStatus
from conveyor.scheduler.config import SchedulerConfig
from conveyor.scheduler.output import ModelOutput

from test_scheduler_props import VOCAB, Sim, make_request


def prompt(n: int, salt: int = 0) -> list[int]:
    return [1 + (salt * 31 + i * 7) % (VOCAB - 1) for i in range(n)]


def decode_plan_bytes(context: int, penalties: bool) -> int:
    """Pickled bytes of a steady decode step (no block boundary) of 4 requests with `context`
    tokens of prompt: what a tensor-parallel driver broadcasts every step."""
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8192, long_prefill_token_threshold=8192,
                          admission_policy="optimistic")
    sim = Sim(cfg, num_blocks=4 * (context // 16 + 4), block_size=16, prefix_caching=False)
    for i in range(4):
        req = make_request(f"r{i}", prompt(context, i), 40, ignore_eos=True, seed=i)
        if penalties:   # the runner needs the output history: it too goes once, not every step
            req.params.presence_penalty = 0.5
        sim.add(req)
    plans = [sim.step() for _ in range(4)]   # prefill, 1st decode (a new block each), 2 steady decodes
    steady = plans[-1]
    assert all(s.num_tokens == 1 and s.new is None and not s.new_block_ids for s in steady.scheduled)
    assert len(steady.scheduled) == 4 and not steady.forget_ids
    steady.step = 0   # (the step counter is not what is measured)
    return len(pickle.dumps(steady))


@pytest.mark.parametrize("penalties", [False, True])
def test_a_decode_plan_does_not_grow_with_the_context(penalties):
    short, long = decode_plan_bytes(256, penalties), decode_plan_bytes(2048, penalties)
    # The only difference may be the encoding of a position (256 vs 2048 both take 2 bytes).
    assert abs(long - short) <= 8, (short, long)
    assert long < 2048   # a single copy of one table of 128 block ids would already be ~300 bytes


def test_a_running_request_gets_only_its_new_blocks():
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, long_prefill_token_threshold=8)
    sim = Sim(cfg, num_blocks=32, block_size=4)
    sim.add(make_request("a", prompt(20), 30, ignore_eos=True))
    seen: list[int] = []
    for _ in range(40):
        plan = sim.step()
        for s in plan.scheduled:
            if s.new is not None:
                assert not seen, "sent in full twice without leaving the runner"
                seen = list(s.new_block_ids)
            else:
                assert len(s.new_block_ids) <= -(-s.num_tokens // 4)   # at most the blocks its chunk opens
                seen += s.new_block_ids
            if not sim.all["a"].is_finished:
                assert seen == sim.kv.block_table("a")
    assert sim.all["a"].is_finished


def run_until(sim: Sim, cond, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if cond():
            return
        sim.step()
    raise AssertionError("condition never met")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_preempted_request_is_forgotten_or_kept_and_its_table_sent_again(mode):
    """Memory for about one and a half requests: the low-priority one is preempted for the
    high-priority arrival. By recompute, the runner forgets it in that very plan and it comes
    back in full; by swap, the runner keeps its state (sampling rows, a pooled sum) and gets its
    new table whole on swap-in. The outputs stay exact (Sim checks the KV it reads, and the
    runner's tables against the KV manager's, every step)."""
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, preemption_mode=mode,
                          admission_policy="optimistic", min_resident_steps=0)
    sim = Sim(cfg, num_blocks=12, block_size=4, num_host_blocks=16)
    low = sim.add(make_request("low", prompt(16, 1), 20, ignore_eos=True, priority=1, seed=1))
    run_until(sim, lambda: low.num_output_tokens >= 3)
    sim.add(make_request("high", prompt(24, 2), 12, ignore_eos=True, priority=0, seed=2))
    for _ in range(50):
        plan = sim.step()
        if low.metrics.num_preemptions:
            break
    assert low.metrics.num_preemptions == 1 and low.status != RequestStatus.RUNNING
    assert (low.status == RequestStatus.SWAPPED) == (mode == "swap")
    assert ("low" in plan.forget_ids) == (mode == "recompute") and ("low" in sim.exe.state) == (mode == "swap")
    resent = None
    while resent is None:
        plan = sim.step()
        resent = next((s for s in plan.scheduled if s.request_id == "low"), None)
    if mode == "recompute":
        assert resent.new is not None and resent.new.num_output_tokens == low.num_output_tokens - resent.sample
    else:
        assert resent.new is None and resent.replace_table
    assert resent.new_block_ids == sim.kv.block_table("low") == sim.exe.state.block_table("low")
    sim.run(200)
    sim.check_outputs()


def test_an_abort_and_a_finish_while_nothing_runs_are_forgotten_later():
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    sim = Sim(cfg, num_blocks=32, block_size=4)
    sim.add(make_request("a", prompt(6, 1), 30, ignore_eos=True, seed=1))
    sim.add(make_request("b", prompt(6, 2), 2, ignore_eos=True, seed=2))
    run_until(sim, lambda: sim.all["b"].is_finished)
    sim.abort("a")
    assert not sim.sched.has_unfinished() and {"a", "b"} <= set(sim.exe.state.requests)   # nothing ran since
    plan = sim.step()
    assert plan.is_empty and not plan.forget_ids   # an empty plan reaches no executor: they stay pending
    sim.add(make_request("c", prompt(5, 3), 3, ignore_eos=True, seed=3))
    plan = sim.step()
    assert {"a", "b"} <= set(plan.forget_ids)
    assert set(sim.exe.state.requests) == {"c"}
    sim.run(100)
    sim.check_outputs()


def test_a_reused_request_id_is_new_to_the_runner():
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    sim = Sim(cfg, num_blocks=32, block_size=4)
    first = sim.add(make_request("x", prompt(9, 1), 3, ignore_eos=True, seed=1))
    sim.run(100)
    assert first.is_finished and "x" in sim.exe.state   # its forget is pending: nothing ran since
    sim.ended.discard("x")   # (Sim's bookkeeping is by id: the new "x" has not ended)
    second = sim.add(make_request("x", prompt(5, 2), 4, ignore_eos=True, seed=7))
    plan = sim.step()
    (seq,) = plan.scheduled
    assert "x" in plan.forget_ids and seq.new is not None and seq.new.num_output_tokens == 0
    assert sim.exe.state.block_table("x") == sim.kv.block_table("x")
    sim.run(100)
    assert second.num_output_tokens == 4
    sim.check_outputs()


def test_results_are_matched_by_request_id_not_by_position():
    """An executor whose results come in another order than the plan's (as the model runner's rows
    do: prefills first, decodes by context length) still gives every request its own token."""
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, long_prefill_token_threshold=5)
    sim = Sim(cfg, num_blocks=64, block_size=4)
    execute = sim.exe.execute

    def reversed_results(plan):
        out = execute(plan)
        return ModelOutput(dict(reversed(out.sampled.items())), out.logprobs, out.prompt_logprobs, out.embeddings)

    sim.exe.execute = reversed_results
    for i in range(6):
        sim.add(make_request(f"r{i}", prompt(3 + 4 * i, i), 10, out_len=4 + i, seed=100 + i))
    sim.run(200)
    sim.check_outputs()
