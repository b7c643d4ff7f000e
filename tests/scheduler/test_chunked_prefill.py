"""Chunked prefill: decodes never stall behind a long prompt, the per-request chunk cap, no
head-of-line blocking of short prompts, and static batching as the contrast."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.request import RequestStatus
from conveyor.scheduler.config import SchedulerConfig
from test_scheduler_props import Sim, make_request


def decoding(sim: Sim) -> set[str]:
    return {r.request_id for r in sim.sched.running if r.num_tokens - r.num_computed_tokens == 1}


def test_long_prompt_does_not_stall_decodes():
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=20, long_prefill_token_threshold=12)
    sim = Sim(cfg, 128, 4)
    decs = [sim.add(make_request(f"d{i}", [1 + i] * 5, 60, ignore_eos=True, seed=i)) for i in range(4)]
    while decoding(sim) != {r.request_id for r in decs}:
        sim.step()
    long = sim.add(make_request("long", list(range(1, 41)) * 5, 4, ignore_eos=True))   # 200 tokens
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        before = decoding(sim)
        out = sim.step()
        got = {s.request_id: s.num_tokens for s in out.scheduled}
        for rid in before:
            assert got.get(rid) == 1, f"decode {rid} stalled at step {out.step}"
        chunks.append(got.get("long", 0))
    # 20 tokens a step, 4 go to the decodes, the long prompt gets the rest up to its cap of 12
    assert all(c <= 12 for c in chunks)
    assert set(chunks[:-1]) == {12} and sum(chunks) == 200
    sim.run(500)
    sim.check_outputs()


def test_default_prefill_cap_is_a_quarter_of_the_budget_but_at_least_64():
    assert SchedulerConfig(max_num_batched_tokens=1024).prefill_chunk_cap == 256
    assert SchedulerConfig(max_num_batched_tokens=100).prefill_chunk_cap == 64
    assert SchedulerConfig(max_num_batched_tokens=1024, long_prefill_token_threshold=10).prefill_chunk_cap == 10
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=1024)
    sim = Sim(cfg, 64, 16)
    r = sim.add(make_request("r", [3] * 600, 2, ignore_eos=True))
    sizes = []
    while r.num_output_tokens == 0:
        sizes.append(sim.step().scheduled[0].num_tokens)
    assert sizes == [256, 256, 88]


def test_short_prompts_behind_a_long_one_are_admitted_in_the_same_step():
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, long_prefill_token_threshold=16)
    sim = Sim(cfg, 128, 4)
    sim.add(make_request("long", [5] * 100, 3, ignore_eos=True))
    for i in range(3):
        sim.add(make_request(f"s{i}", [6 + i] * 4, 3, ignore_eos=True, seed=i))
    out = sim.step()
    got = {s.request_id: s.num_tokens for s in out.scheduled}
    assert got == {"long": 16, "s0": 4, "s1": 4, "s2": 4}
    assert [s.sample for s in out.scheduled] == [False, True, True, True]
    # in the next step the shorts decode and the long prompt takes its next chunk
    out = sim.step()
    assert {s.request_id: s.num_tokens for s in out.scheduled} == {"s0": 1, "s1": 1, "s2": 1, "long": 16}
    sim.run(200)
    sim.check_outputs()


def test_static_batching_admits_nobody_until_the_batch_finishes():
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, long_prefill_token_threshold=8,
                          scheduling_policy="static")
    sim = Sim(cfg, 64, 4)
    a = sim.add(make_request("a", [1] * 30, 5, ignore_eos=True))
    b = sim.add(make_request("b", [2] * 3, 20, ignore_eos=True))
    sim.step()
    late = sim.add(make_request("late", [3] * 2, 2, ignore_eos=True))
    while not (a.is_finished and b.is_finished):
        out = sim.step()
        assert "late" not in {s.request_id for s in out.scheduled}
        assert late.status == RequestStatus.WAITING
    out = sim.step()
    assert [s.request_id for s in out.scheduled] == ["late"]
    sim.run(50)
    sim.check_outputs()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10), st.integers(1, 90), st.integers(1, 12)), min_size=1, max_size=8),
       st.integers(8, 48), st.sampled_from([0, 1, 5, 16]), st.sampled_from([1, 4, 16]), st.booleans())
def test_decodes_never_wait_when_the_budget_covers_them(reqs, budget, cap, block_size, caching):
    """With ample memory and budget >= number of decodes, every decode runs in every step, and
    no request gets more than the cap in a step."""
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, long_prefill_token_threshold=cap)
    sim = Sim(cfg, 4096 // block_size, block_size, prefix_caching=caching)
    pending = sorted((t, i, plen, mt) for i, (t, plen, mt) in enumerate(reqs))
    t = 0
    while pending or sim.sched.has_unfinished():
        while pending and pending[0][0] <= t:
            _, i, plen, mt = pending.pop(0)
            sim.add(make_request(f"r{i}", [1 + (i % 3)] * plen, mt, ignore_eos=True, seed=i))
        before = decoding(sim)
        out = sim.step()
        got = {s.request_id: s.num_tokens for s in out.scheduled}
        if len(before) <= budget:
            assert all(got.get(rid) == 1 for rid in before)
        assert all(n <= cfg.prefill_chunk_cap for n in got.values())
        assert sim.sched.stats.num_preemptions == 0
        t += 1
        assert t < 2000
    sim.check_outputs()
