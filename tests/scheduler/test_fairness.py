"""Fair scheduling between tenants (scheduler/fairness.py, VTC) on the real scheduler, stepped by
EngineCore with the checking fake executor of test_scheduler_props.py: one tenant is exactly FCFS;
backlogged tenants' service stays within VTC's bound, by weight; a light tenant is not starved by
a flooding one; a tenant's running cap holds without holding others back."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.request import RequestStatus
from conveyor.scheduler.config import SchedulerConfig, parse_tenant_weights
from conveyor.scheduler.fairness import FairQueue, TenantLedger, TokenWeights
from test_scheduler_props import Sim, make_request

import pytest


def flood(sim: Sim, tenant: str, n: int, prompt: int, out: int, start: int = 0) -> list:
    reqs = []
    for i in range(n):
        req = make_request(f"{tenant}-{start + i}", [1 + (i + j) % 40 for j in range(prompt)], out + 5, out_len=out,
                           seed=i)
        req.tenant = tenant
        reqs.append(sim.add(req))
    return reqs


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 1), st.integers(0, 3)),
                min_size=1, max_size=14),
       st.sampled_from(["", "solo"]))
def test_one_tenant_is_exactly_fcfs(specs, tenant):
    """With every request of one tenant, vtc plans every step exactly as fcfs does."""
    plans = {}
    for policy in ("vtc", "fcfs"):
        sim = Sim(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=24, tenant_fairness=policy,
                                  preemption_mode="swap"), num_blocks=24, block_size=4, num_host_blocks=64)
        log = []
        for i, (plen, olen, prio, when) in enumerate(specs):
            req = make_request(f"r{i}", [1 + (i * 7 + j) % 40 for j in range(plen)], olen + 2, out_len=olen,
                               priority=prio, seed=i)
            req.tenant = tenant
            sim.add(req)
            if when:   # arrivals spread over the first steps
                for _ in range(when):
                    log.append([(s.request_id, s.num_tokens) for s in sim.step().scheduled])
        while sim.sched.has_unfinished():
            log.append([(s.request_id, s.num_tokens) for s in sim.step().scheduled])
        sim.check_outputs()
        plans[policy] = log
    assert plans["vtc"] == plans["fcfs"]


def backlogged_steps(sim: Sim, tenants: tuple[str, ...]):
    """Step while every tenant still has queued requests; yields after each step."""
    while all(any(r.status in (RequestStatus.WAITING, RequestStatus.SWAPPED) and r.tenant == t
                  for r in sim.sched.requests.values()) for t in tenants):
        sim.step()
        yield


@pytest.mark.parametrize("weights", ["", "light=3"])
def test_backlogged_tenants_stay_within_the_vtc_bound(weights):
    """Both tenants always have work queued; the heavy one has 5x the requests and was there first.
    Their weighted service never differs by more than VTC's bound (two requests' worth of weighted
    tokens), and the real tokens they get are split by their weights."""
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, tenant_weights=weights or None)
    sim = Sim(cfg, num_blocks=256, block_size=4)
    flood(sim, "heavy", 150, 24, 12)
    flood(sim, "light", 40, 24, 12)
    w = sim.sched.tenants.token_weights
    bound = 2 * (w.prefill * 24 + w.decode * 17)   # prompt + max_tokens of one request, twice
    ledger, steps = sim.sched.tenants, 0
    for _ in backlogged_steps(sim, ("heavy", "light")):
        steps += 1
        assert abs(ledger.counter("heavy") - ledger.counter("light")) <= bound, (steps, ledger.service)
    assert steps > 40   # (the bound was checked over a long backlogged stretch)
    share = parse_tenant_weights(weights).get("light", 1.0)
    tokens = ledger.tokens   # (the bound is a few requests' worth of tokens: small against the stretch)
    assert abs(tokens["light"] / tokens["heavy"] - share) < 0.2 * share, tokens


def test_a_flooding_tenant_does_not_starve_a_light_one():
    """The heavy tenant queued 60 requests before the light one's request arrives: under vtc the
    light request is the next one admitted (at most one heavy request, tied with it, goes first);
    under fcfs it waits behind the whole flood."""
    admitted_before = {}
    for policy in ("vtc", "fcfs"):
        sim = Sim(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, tenant_fairness=policy),
                  num_blocks=256, block_size=4)
        flood(sim, "heavy", 60, 16, 8)
        for _ in range(30):
            sim.step()
        light = flood(sim, "light", 1, 16, 8)[0]
        heavy_started = sum(r.metrics.first_scheduled_time is not None for r in sim.all.values() if r.tenant == "heavy")
        sim.run(5000)
        after = sum(r.metrics.first_scheduled_time is not None and r.tenant == "heavy"
                    and r.metrics.first_scheduled_time < light.metrics.first_scheduled_time for r in sim.all.values())
        admitted_before[policy] = after - heavy_started
        sim.check_outputs()
    assert admitted_before["vtc"] <= 1
    assert admitted_before["fcfs"] >= 40


def test_a_tenants_running_cap_holds_and_others_fill_the_slots():
    cfg = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=128, tenant_max_running=2)
    sim = Sim(cfg, num_blocks=512, block_size=4)
    flood(sim, "heavy", 30, 12, 6)
    flood(sim, "light", 4, 12, 6)
    peak = Counter()
    while sim.sched.has_unfinished():
        sim.step()
        running = Counter(r.tenant for r in sim.sched.running)
        assert all(n <= 2 for n in running.values()), running
        peak.update({t: 0 for t in running})
        for t, n in running.items():
            peak[t] = max(peak[t], n)
    sim.check_outputs()
    assert peak["heavy"] == 2 and peak["light"] == 2   # capped, yet both ran side by side


def test_a_returning_tenant_cannot_bank_credit():
    """A tenant idle while another was served comes back at the least counter of those with work,
    not at its old (lower) one, so it gets its share from then on, not a burst."""
    ledger = TenantLedger()
    ledger.arrived("a")
    ledger.charge("a", 1000, 0)
    ledger.arrived("b")   # b was never served: lifted to a's service
    assert ledger.counter("b") == ledger.counter("a") == 1000
    ledger.left("b")
    ledger.charge("a", 500, 0)
    ledger.arrived("b")
    assert ledger.counter("b") == 1500


def test_the_queue_orders_by_priority_then_service_then_arrival():
    ledger = TenantLedger()
    queue = FairQueue(ledger)
    reqs = {}
    for i, (tenant, prio) in enumerate([("a", 0), ("a", 0), ("b", 0), ("c", 1), ("b", 0)]):
        req = make_request(f"{tenant}{i}", [1, 2], 4)
        req.tenant, req.priority, req.arrival_seq = tenant, prio, i
        ledger.arrived(tenant)
        queue.push(req)
        reqs[req.request_id] = req
    ledger.charge("a", 10, 0)   # a was served: b goes first among priority 0
    order = []
    while len(queue):
        req = queue.pop()
        order.append(req.request_id)
        ledger.charge(req.tenant, 4, 0)
    # b (0 < 10) twice (4, 8 < 10), then a's two in arrival order; c's worse priority last
    assert order == ["b2", "b4", "a0", "a1", "c3"]
    assert TokenWeights.of(None) == TokenWeights()


def test_tenant_weights_are_checked():
    assert parse_tenant_weights("a=2, b=0.5") == {"a": 2.0, "b": 0.5}
    for bad in ("a", "a=0", "=2", "a=x", "a=inf"):
        with pytest.raises(ValueError, match="tenant_weights"):
            SchedulerConfig(tenant_weights=bad)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 10), st.integers(0, 2), st.sampled_from("abc"),
                          st.integers(0, 2)), min_size=2, max_size=16),
       st.integers(0, 2), st.sampled_from(["swap", "recompute"]))
def test_every_request_of_every_tenant_finishes(specs, cap, mode):
    """Tenants, priorities, a running cap and preemption (priority preemption gives a victim's tenant
    tokens back and may lift its cap between a peek and the admission): nobody is lost from the
    queue, every request finishes with its own output, every block comes back."""
    sim = Sim(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=20, tenant_max_running=cap,
                              preemption_mode=mode), num_blocks=20, block_size=4, num_host_blocks=40)
    for i, (plen, olen, prio, tenant, when) in enumerate(specs):
        req = make_request(f"{tenant}{i}", [1 + (i * 5 + j) % 40 for j in range(plen)], olen + 1, out_len=olen,
                           priority=prio, seed=i)
        req.tenant = tenant
        sim.add(req)
        for _ in range(when):
            sim.step()
    sim.run(5000)
    sim.check_outputs()
    assert all(r.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH) for r in sim.all.values())


def test_take_takes_the_peeked_request_even_when_the_order_moved():
    ledger = TenantLedger()
    queue = FairQueue(ledger)
    a, b = make_request("a", [1], 2), make_request("b", [1], 2)
    for i, (req, tenant) in enumerate(((a, "x"), (b, "y"))):
        req.tenant, req.arrival_seq = tenant, i
        ledger.arrived(tenant)
        queue.push(req)
    assert queue.peek() is a
    ledger.charge("x", 100, 0)   # x was served since the peek: y's line ranks first now
    queue.take(a)
    assert queue.peek() is b and len(queue) == 1


def test_a_lora_request_waiting_for_an_adapter_slot_is_not_starved():
    """One adapter slot: adapter A's requests run; B's request comes next, then a stream of A's. The
    A requests behind B wait with it until A's running requests drain and B comes in (before, they
    kept A held forever); base-model requests are not held back. The runner never holds two."""
    from conveyor.lora.request import LoRARequest

    sim = Sim(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), num_blocks=256, block_size=4)
    sim.sched.max_loras = 1
    lora_a, lora_b = LoRARequest("a", 1, ""), LoRARequest("b", 2, "")

    def add(rid: str, lora, out_len: int = 8) -> object:
        req = make_request(rid, [1 + len(rid), 2, 3, 4, 5], out_len + 1, out_len=out_len)
        req.lora = lora
        return sim.add(req)

    early = [add("a0", lora_a, 4), add("a1", lora_a, 9)]   # they finish apart: A stays held in between
    sim.step()
    b = add("b", lora_b)
    later = [add(f"a{i}", lora_a, 4 + i % 5) for i in range(2, 22)] + [add("base", None)]
    held = []
    while sim.sched.has_unfinished():
        sim.step()
        held.append(len(sim.sched._held_loras))
    sim.check_outputs()
    assert max(held) == 1
    start = lambda r: r.metrics.first_scheduled_time   # noqa: E731
    assert all(start(b) > start(r) for r in early)
    assert sum(start(r) > start(b) for r in later if r.lora is lora_a) == 20   # every later A after B


def test_the_ledger_forgets_tenants_without_work():
    """A million one-off `user` values must not grow the ledger: a tenant that leaves at or below the
    least counter of those with work is forgotten (its return lifts it there anyway)."""
    ledger = TenantLedger()
    ledger.max_idle = 64
    ledger.arrived("steady")
    ledger.charge("steady", 50, 0)
    for i in range(1000):
        ledger.arrived(f"u{i}")
        if i % 2:
            ledger.charge(f"u{i}", 0, 1)   # left ahead of "steady": kept, up to max_idle of them
        ledger.left(f"u{i}")
    assert "steady" in ledger.service and len(ledger.service) <= 1 + 64
    assert ledger.counter("u999") > ledger.counter("steady")   # the latest one served still carries its lead
    ledger.left("steady")
    assert not ledger.service and not ledger.live
