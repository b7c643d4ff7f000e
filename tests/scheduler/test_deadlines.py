"""Queue deadlines (scheduler/deadlines.py) through the real EngineCore with the fake executor: a request
that waited past its max_queue_time before its first scheduling fails with a clear error while the
others are served exactly, no block leaks (``Sim`` checks every step), and a request that has run
once never expires."""

from __future__ import annotations

import pytest

from conveyor.request import RequestStatus
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler.config import SchedulerConfig
from conveyor.scheduler.deadlines import QUEUE_TIMEOUT, DeadlineHeap, queue_limit
from test_scheduler_props import Sim, make_request


def with_deadline(req, seconds):
    req.params.max_queue_time = seconds
    return req


def step_collecting(sim: Sim, updates: list) -> None:
    """One Sim step that also keeps the core's updates."""
    step = sim.core.step

    def keep():
        out = step()
        updates.extend(out)
        return out

    sim.core.step = keep
    try:
        sim.step()
    finally:
        sim.core.step = step


def test_a_request_past_its_deadline_fails_while_the_others_are_served():
    cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64)
    sim = Sim(cfg, num_blocks=32, block_size=4)
    sim.add(make_request("busy", [1, 2, 3, 4, 5], 6, ignore_eos=True, seed=1))
    late = sim.add(with_deadline(make_request("late", [6, 7, 8], 4, ignore_eos=True, seed=2), 0.5))
    sim.add(make_request("patient", [9, 10], 4, ignore_eos=True, seed=3))
    sim.step()                                   # busy holds the only slot
    assert late.status == RequestStatus.WAITING
    sim.time += 1.0                              # late has now waited 1 s, twice its limit
    updates: list = []
    step_collecting(sim, updates)
    assert late.status == RequestStatus.FINISHED_ERROR and late.metrics.first_scheduled_time is None
    assert "queue timeout" in late.error and "max_queue_time of 0.5 s" in late.error
    (u,) = [u for u in updates if u.seq_id == "late"]
    assert u.error == late.error and u.error_code == QUEUE_TIMEOUT and u.finish_reason == "error"
    sim.run(200)
    sim.check_outputs()                          # busy and patient got exactly their tokens
    assert sim.all["busy"].status == sim.all["patient"].status == RequestStatus.FINISHED_LENGTH
    sim.check_idle()                             # nothing leaked
    s = sim.core.engine_stats()
    assert s.num_queue_timeouts == 1 and s.num_errors == 1
    assert s.kv_invariant_violations == 0


def test_the_engine_limit_applies_and_a_request_can_only_shorten_it():
    cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_queue_time=2.0)
    assert queue_limit(make_request("x", [1], 1), 2.0) == 2.0
    assert queue_limit(with_deadline(make_request("x", [1], 1), 10.0), 2.0) == 2.0
    assert queue_limit(with_deadline(make_request("x", [1], 1), 0.5), 2.0) == 0.5
    assert queue_limit(with_deadline(make_request("x", [1], 1), 0.5), None) == 0.5
    assert queue_limit(make_request("x", [1], 1), None) is None
    sim = Sim(cfg, num_blocks=32, block_size=4)
    sim.add(make_request("busy", [1, 2, 3], 8, ignore_eos=True))
    asks_more = sim.add(with_deadline(make_request("asks_more", [4, 5], 2, ignore_eos=True), 100.0))
    asks_less = sim.add(with_deadline(make_request("asks_less", [6, 7], 2, ignore_eos=True), 0.5))
    default = sim.add(make_request("default", [8, 9], 2, ignore_eos=True))
    sim.step()
    sim.time += 1.0
    sim.step()
    assert asks_less.status == RequestStatus.FINISHED_ERROR
    assert asks_more.status == default.status == RequestStatus.WAITING
    sim.time += 1.5
    sim.step()
    assert asks_more.status == default.status == RequestStatus.FINISHED_ERROR   # the engine's 2 s cap
    assert "max_queue_time of 2 s" in asks_more.error
    sim.run(100)
    sim.check_idle()
    assert sim.core.engine_stats().num_queue_timeouts == 3


def test_a_recompute_preempted_request_waiting_again_does_not_expire():
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, preemption_mode="recompute",
                          admission_policy="optimistic", min_resident_steps=1)
    sim = Sim(cfg, num_blocks=6, block_size=4)
    reqs = [sim.add(with_deadline(make_request(f"r{i}", [1 + i] * 4, 14, ignore_eos=True, seed=i), 0.5))
            for i in range(2)]
    for _ in range(100):
        sim.step()
        back = [r for r in reqs if r.status == RequestStatus.WAITING and r.metrics.num_preemptions]
        if back:
            break
    else:
        pytest.fail("no request was preempted by recompute")
    sim.time += 100.0                            # far past the deadline, but it ran before
    sim.run(500)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert sim.core.engine_stats().num_queue_timeouts == 0
    sim.check_outputs()
    sim.check_idle()


def test_a_follower_whose_leader_runs_does_not_expire():
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, long_prefill_token_threshold=8)
    sim = Sim(cfg, num_blocks=32, block_size=4)
    prompt = list(range(1, 41))
    leader = sim.add(with_deadline(make_request("lead", prompt, 3, ignore_eos=True, seed=1), 0.5))
    follower = sim.add(with_deadline(make_request("follow", prompt, 3, ignore_eos=True, seed=2, leader=leader), 0.5))
    sim.step()                                   # the leader's first chunk; the follower waits for its prefill
    assert leader.status == RequestStatus.RUNNING and follower.status == RequestStatus.WAITING
    sim.time += 100.0
    sim.run(200)
    assert leader.status == follower.status == RequestStatus.FINISHED_LENGTH
    sim.check_outputs()


def test_a_whole_group_that_never_ran_expires_together():
    cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64)
    sim = Sim(cfg, num_blocks=32, block_size=4)
    sim.add(make_request("busy", [1, 2, 3], 4, ignore_eos=True))
    lead = sim.add(with_deadline(make_request("lead", [5, 6, 7], 2), 0.5))
    follow = sim.add(with_deadline(make_request("follow", [5, 6, 7], 2, leader=lead), 0.5))
    sim.step()
    sim.time += 1.0
    sim.step()
    assert lead.status == follow.status == RequestStatus.FINISHED_ERROR
    sim.run(50)
    sim.check_idle()


def test_the_heap_pops_only_expired_entries_and_stays_bounded():
    requests: dict = {}
    heap = DeadlineHeap(requests)
    for i in range(3000):
        r = with_deadline(make_request(f"r{i}", [1], 1), 1.0 + i % 10)
        r.arrival_time, r.arrival_seq = 0.0, i
        requests[r.request_id] = r
        heap.push(r, None)
    expired = heap.pop_expired(3.5)              # deadlines 1, 2 and 3
    assert len(expired) == 900 and all(r.params.max_queue_time <= 3 for r in expired)
    assert len(heap) == 2100                     # nothing else was touched
    for r in expired:
        del requests[r.request_id]
    # Requests that leave before their deadline: their entries do not pile up.
    for i in range(3000, 20_000):
        r = with_deadline(make_request(f"r{i}", [1], 1), 1000.0)
        r.arrival_time, r.arrival_seq = 0.0, i
        requests[r.request_id] = r
        heap.push(r, None)
        r.metrics.first_scheduled_time = 0.0    # scheduled at once: its deadline is void
        if i % 2:
            del requests[r.request_id]          # and finished
    assert len(heap) <= 2 * len(requests) + 1025
    left = sorted((i for i in range(3000) if i % 10 >= 3), key=lambda i: (i % 10, i))   # (deadline, arrival)
    assert [r.request_id for r in heap.pop_expired(2000.0)] == [f"r{i}" for i in left]
    assert len(heap) == 0


def test_max_queue_time_is_validated():
    with pytest.raises(ValueError, match="max_queue_time"):
        SamplingParams(max_queue_time=0)
    with pytest.raises(ValueError, match="max_queue_time"):
        SamplingParams(max_queue_time=float("nan"))
    with pytest.raises(ValueError, match="max_queue_time"):
        SchedulerConfig(max_queue_time=-1.0)
    assert SamplingParams(max_queue_time=0.25).max_queue_time == 0.25
