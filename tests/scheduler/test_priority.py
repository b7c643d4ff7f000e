"""Priority scheduling: lower number runs first, FCFS within a priority, preemption of lower
priority work, queue position kept across preemption, and the anti-thrash residency rule."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import conveyor.scheduler.scheduler as scheduler_mod
from conveyor.request import RequestStatus
from conveyor.scheduler.config import SchedulerConfig
from test_scheduler_props import Sim, make_request


def first_steps(sim: Sim) -> dict[str, int]:
    """Step at which each request was first scheduled."""
    first: dict[str, int] = {}
    for e in sim.log:
        for rid in e.scheduled:
            first.setdefault(rid, e.step)
    return first


def runs_after(sim: Sim, rid: str, step: int) -> int:
    """First step after ``step`` in which rid was scheduled."""
    return next(e.step for e in sim.log if e.step > step and rid in e.scheduled)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_high_priority_preempts_when_max_num_seqs_reached(mode):
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, min_resident_steps=3, preemption_mode=mode,
                          admission_policy="optimistic")
    sim = Sim(cfg, 64, 4, num_host_blocks=32)
    l0 = sim.add(make_request("L0", [1] * 6, 30, ignore_eos=True, priority=1))
    l1 = sim.add(make_request("L1", [2] * 6, 30, ignore_eos=True, priority=1))
    for _ in range(4):
        sim.step()
    l2 = sim.add(make_request("L2", [3] * 6, 30, ignore_eos=True, priority=1))
    h = sim.add(make_request("H", [4] * 6, 10, ignore_eos=True, priority=0))
    out = sim.step()
    ids = {s.request_id for s in out.scheduled}
    assert "H" in ids and "L2" not in ids
    # the victim is the worst-ranked running request: lowest priority, latest arrival
    assert l1.status == (RequestStatus.SWAPPED if mode == "swap" else RequestStatus.WAITING)
    assert l0.status == RequestStatus.RUNNING and l2.status == RequestStatus.WAITING
    assert sim.sched.stats.num_priority_preemptions == 1
    sim.run(500)
    sim.check_outputs()
    first = first_steps(sim)
    # the preempted L1 keeps its place ahead of the later L2
    assert runs_after(sim, "L1", out.step) < first["L2"]
    assert h.metrics.finished_time < l2.metrics.finished_time


def test_high_priority_preempts_when_memory_is_full():
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, min_resident_steps=2,
                          admission_policy="optimistic")
    sim = Sim(cfg, 16, 4)                      # 64 token slots
    lows = [sim.add(make_request(f"L{i}", [1 + i] * 12, 40, ignore_eos=True, priority=1, seed=i))
            for i in range(4)]
    for _ in range(3):
        sim.step()
    assert sim.kv.num_free_blocks == 0
    waiting_low = sim.add(make_request("Lw", [9] * 4, 4, ignore_eos=True, priority=1))
    h = sim.add(make_request("H", [7] * 8, 4, ignore_eos=True, priority=0))
    out = sim.step()
    assert "H" in {s.request_id for s in out.scheduled}
    assert sim.log[-1].preempted, "someone had to give way"
    assert all(sim.all[r].priority == 1 for r in sim.log[-1].preempted)
    assert waiting_low.status == RequestStatus.WAITING
    sim.run(2000)
    sim.check_outputs()
    assert h.metrics.finished_time < min(r.metrics.finished_time for r in lows)


def test_residency_never_holds_back_a_better_priority():
    """The anti-thrash residency rule protects a freshly admitted request only from requests of
    its own priority: a better-priority arrival preempts it at once (it used to wait out the
    residency, and under memory pressure even preempt itself)."""
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, min_resident_steps=4,
                          admission_policy="optimistic")
    sim = Sim(cfg, 64, 4)
    sim.add(make_request("L0", [1] * 4, 30, ignore_eos=True, priority=2))
    sim.add(make_request("L1", [2] * 4, 30, ignore_eos=True, priority=2))
    sim.step()                                  # both admitted at step 1
    sim.add(make_request("H", [3] * 4, 5, ignore_eos=True, priority=0))
    out = sim.step()
    assert "H" in {s.request_id for s in out.scheduled}
    assert sim.log[-1].preempted == {"L1"}      # the worse-ranked one, resident for one step only
    sim.run(500)
    sim.check_outputs()


def test_fcfs_within_a_priority_and_priority_order_across():
    cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=16)
    sim = Sim(cfg, 32, 4)
    specs = [("a", 1), ("b", 0), ("c", 1), ("d", 2), ("e", 0), ("f", 1)]
    for i, (rid, prio) in enumerate(specs):
        sim.add(make_request(rid, [1 + i] * (3 + 5 * (i % 3)), 3, ignore_eos=True, priority=prio, seed=i))
    sim.run(500)
    order = sorted(first_steps(sim).items(), key=lambda kv: kv[1])
    assert [rid for rid, _ in order] == ["b", "e", "a", "c", "f", "d"]


def test_fcfs_with_a_batch_admission_order():
    """With room for several, admission still follows (priority, arrival): a later request is
    never admitted in a step where an earlier one of the same or better priority is left waiting."""
    cfg = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=12, admission_policy="optimistic")
    sim = Sim(cfg, 24, 2)
    for i in range(9):
        sim.add(make_request(f"r{i}", [1 + i] * (2 + 3 * (i % 4)), 6, out_len=2 + i % 5, priority=i % 2, seed=i))
    sim.run(1000)
    sim.check_outputs()
    first = first_steps(sim)
    reqs = sorted(sim.all.values(), key=lambda r: (r.priority, r.arrival_seq))
    for earlier, later in zip(reqs, reqs[1:]):
        assert first[earlier.request_id] <= first[later.request_id]


class Recorder:
    """Records every preemption, with who asked for it (None: a priority preemption)."""

    def __init__(self, monkeypatch):
        self.events: list[tuple[int, str, int, str | None]] = []   # (step, victim, resumed_step, needy)
        self.overridden: set[tuple[int, str]] = set()   # (step, needy) growths that took resident victims
        real_grow, real_preempt = scheduler_mod.Scheduler._grow, scheduler_mod.Scheduler._preempt
        needy: list = []

        def grow(sched, req, n, scheduled, out):
            needy.append(req)
            before = sched.stats.residency_overrides
            try:
                return real_grow(sched, req, n, scheduled, out)
            finally:
                needy.pop()
                if sched.stats.residency_overrides != before:
                    self.overridden.add((sched.step, req.request_id))

        def preempt(sched, victim, out):
            who = needy[-1].request_id if needy else None
            self.events.append((sched.step, victim.request_id, victim.resumed_step, who))
            real_preempt(sched, victim, out)

        monkeypatch.setattr(scheduler_mod.Scheduler, "_grow", grow)
        monkeypatch.setattr(scheduler_mod.Scheduler, "_preempt", preempt)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 14), st.integers(1, 20), st.integers(0, 2)),
                min_size=2, max_size=10),
       st.integers(0, 5), st.sampled_from(["recompute", "swap"]), st.integers(1, 6))
def test_anti_thrash_rule_holds(reqs, min_resident, mode, max_seqs):
    with pytest.MonkeyPatch.context() as mp:
        rec = Recorder(mp)
        sim = _run_priority_workload(reqs, min_resident, mode, max_seqs)
    for step, victim, resumed, needy in rec.events:
        if needy == victim:
            continue   # a request may always give way itself
        v = sim.all[victim]
        if needy is None:   # a priority preemption: only for a better priority, residency or not
            continue
        n = sim.all[needy]
        # a memory preemption never evicts a better-ranked request, and within a priority only
        # one that has been resident for min_resident steps -- unless no such victim could make
        # room and the needy request would otherwise have stepped back for later arrivals
        assert (v.priority, v.arrival_seq) > (n.priority, n.arrival_seq)
        if v.priority == n.priority and (step, needy) not in rec.overridden:
            assert step - resumed >= min_resident, (step, victim, resumed, needy)


def _run_priority_workload(reqs, min_resident, mode, max_seqs) -> Sim:
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=16, min_resident_steps=min_resident,
                          preemption_mode=mode, admission_policy="optimistic")
    sim = Sim(cfg, 12, 4, num_host_blocks=24)
    pending = sorted(((t, i, plen, mt, prio) for i, (t, plen, mt, prio) in enumerate(reqs)))
    t = 0
    while pending or sim.sched.has_unfinished():
        while pending and pending[0][0] <= t:
            _, i, plen, mt, prio = pending.pop(0)
            sim.add(make_request(f"r{i}", [1 + i] * plen, min(mt, 48 - plen), ignore_eos=True, priority=prio, seed=i))
        sim.step()
        t += 1
        assert t < 3000
    sim.check_outputs()
    return sim


def test_swapped_lower_priority_does_not_take_the_room_of_a_waiting_higher_priority():
    """Regression: _swap_in ran before admissions without looking at the waiting queue, so a
    swapped priority-2 request took the slot a finished request freed although a priority-1
    request was waiting; the priority-1 request then had to wait out the residency rule and
    preempt it again (a swap-in and a swap-out for nothing)."""
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, preemption_mode="swap",
                          admission_policy="optimistic", min_resident_steps=4)
    sim = Sim(cfg, 64, 4, num_host_blocks=64)
    sim.add(make_request("A", [1] * 4, 30, ignore_eos=True, priority=1))
    b = sim.add(make_request("B", [2] * 4, 30, ignore_eos=True, priority=2))
    for _ in range(5):
        sim.step()
    m = sim.add(make_request("M", [3] * 4, 3, ignore_eos=True, priority=0))
    sim.step()
    assert b.status == RequestStatus.SWAPPED            # M pushed B out
    h = sim.add(make_request("H", [4] * 4, 3, ignore_eos=True, priority=1))
    while not m.is_finished:
        sim.step()
    out = sim.step()                                    # M's slot is free now
    assert "H" in {s.request_id for s in out.scheduled}
    assert b.status == RequestStatus.SWAPPED and not out.swap_in
    sim.run(500)
    sim.check_outputs()
    assert sim.sched.stats.num_swaps_out == 1 and b.metrics.num_preemptions == 1
    assert h.metrics.finished_time < b.metrics.finished_time


def test_priority_preemption_is_not_wasted_when_the_head_is_then_deferred():
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, admission_policy="conservative",
                          min_resident_steps=2)
    sim = Sim(cfg, 60, 4)
    sim.add(make_request("L0", [1] * 4, 100, ignore_eos=True, priority=1))
    sim.add(make_request("L1", [2] * 4, 100, ignore_eos=True, priority=1))
    for _ in range(3):
        sim.step()
    sim.add(make_request("H", [3] * 4, 200, ignore_eos=True, priority=0))
    out = sim.step()
    ran = {s.request_id for s in out.scheduled}
    # either H gets in for the preemption it caused, or nobody is preempted for it
    assert "H" in ran or sim.sched.stats.num_priority_preemptions == 0


def test_high_priority_prefill_does_not_give_way_to_a_lower_priority_decode():
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=3, long_prefill_token_threshold=2,
                          admission_policy="optimistic", min_resident_steps=0)
    sim = Sim(cfg, 11, 4, prefix_caching=False)
    low = sim.add(make_request("L", [1] * 4, 40, ignore_eos=True, priority=1))
    sim.step()
    sim.step()
    high = sim.add(make_request("H", [2] * 26, 4, ignore_eos=True, priority=0))
    while not high.is_finished:
        was_running = high.status == RequestStatus.RUNNING
        out = sim.step()
        ran = {s.request_id for s in out.scheduled}
        assert not (was_running and high.status == RequestStatus.WAITING and "L" in ran), \
            f"step {out.step}: H gave way while lower-priority L ran"
    assert high.metrics.num_preemptions == 0
    assert low.metrics.num_preemptions >= 1   # memory ran out: the low-priority request gave way


@pytest.mark.parametrize("caching", [True, False])
def test_follower_waiting_for_its_leader_does_not_trigger_priority_preemption(caching):
    """Regression: the head of the queue was a high-priority n>1 follower held back for its
    leader's prefill; _preempt_for_priority kept preempting a low-priority request for it in
    every step (min_resident_steps=0), and _admit re-admitted the victim from scratch each time,
    so the victim made no progress until the leader's prefill ended."""
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=2, long_prefill_token_threshold=1,
                          admission_policy="optimistic", min_resident_steps=0)
    sim = Sim(cfg, 7, 4, prefix_caching=caching)
    leader = sim.add(make_request("lead", [1] * 20, 1))
    sim.add(make_request("follow", [1] * 20, 1, leader=leader))
    low = sim.add(make_request("low", [5] * 6, 2, priority=1))
    sim.run(200)
    sim.check_outputs()
    assert sim.sched.stats.num_priority_preemptions <= 1
    assert low.metrics.num_preemptions <= 1


def test_siblings_do_not_wait_for_the_leader_without_a_prefix_cache():
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, long_prefill_token_threshold=8)
    for caching, together in ((True, False), (False, True)):
        sim = Sim(cfg, 32, 4, prefix_caching=caching)
        lead = sim.add(make_request("lead", [1] * 20, 2))
        sim.add(make_request("follow", [1] * 20, 2, leader=lead))
        out = sim.step()
        assert ("follow" in {s.request_id for s in out.scheduled}) == together
        sim.run(100)
        sim.check_outputs()
