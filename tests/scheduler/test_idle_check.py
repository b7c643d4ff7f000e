"""The production leak check: when the last request leaves, EngineCore checks that the KV cache is whole
again, once per transition to idle; a corrupt state is logged and counted, and the engine goes on."""

from __future__ import annotations

import logging

from conveyor.core.engine_core import idle_violations
from conveyor.request import RequestStatus
from conveyor.scheduler.config import SchedulerConfig
from test_scheduler_props import Sim, make_request

CFG = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)


def counts(sim: Sim) -> tuple[int, int]:
    s = sim.core.engine_stats()
    return s.kv_invariant_checks, s.kv_invariant_violations


def always_full(sim: Sim) -> Sim:
    sim.core.idle_check_share = None   # the block-by-block part on every transition, however fast they come
    return sim


def test_checked_once_per_transition_to_idle():
    sim = Sim(CFG, num_blocks=16, block_size=4, num_host_blocks=8)
    assert counts(sim) == (0, 0)
    sim.add(make_request("a", [1, 2, 3], 6, ignore_eos=True))
    sim.add(make_request("b", [4, 5], 3, ignore_eos=True))
    sim.run(50)                                  # several steps, one transition to idle
    assert counts(sim) == (1, 0)
    sim.core.step()                              # idle steps check nothing
    assert counts(sim) == (1, 0)
    sim.add(make_request("c", [6, 7], 2))
    sim.abort("c")                               # the last request leaves outside a step
    assert counts(sim) == (2, 0)
    assert idle_violations(sim.sched) == []


def test_a_corrupt_ref_count_is_logged_and_counted_and_the_engine_goes_on(caplog):
    sim = always_full(Sim(CFG, num_blocks=16, block_size=4, check=False))   # Sim's own per-step checks would raise
    sim.add(make_request("a", [1, 2, 3], 2, ignore_eos=True))
    sim.run(20)
    assert counts(sim) == (1, 0)
    # A leak: a free block keeps an owner (the tail of the free queue, so no request reallocates it).
    victim = next(reversed(sim.kv.pool.free))
    sim.kv.pool.blocks[victim].ref_count += 1
    sim.add(make_request("b", [4, 5, 6], 2, ignore_eos=True, seed=1))
    with caplog.at_level(logging.ERROR, logger="conveyor.core.engine_core"):
        sim.run(20)
    assert sim.all["b"].status == RequestStatus.FINISHED_LENGTH
    assert counts(sim) == (2, 1)
    (record,) = [r for r in caplog.records if "KV cache invariant violated" in r.getMessage()]
    assert f"block {victim}" in record.getMessage()
    assert not sim.core.dead
    # The engine keeps serving; once the state is repaired the next transition is clean again.
    sim.kv.pool.blocks[victim].ref_count -= 1
    sim.add(make_request("c", [7, 8], 3, ignore_eos=True, seed=2))
    sim.run(20)
    assert sim.all["c"].status == RequestStatus.FINISHED_LENGTH
    assert counts(sim) == (3, 1)
    sim.check_outputs()


def test_leaked_blocks_and_a_stray_table_are_reported():
    sim = always_full(Sim(CFG, num_blocks=16, block_size=4, check=False))
    sim.kv.pool.allocate(2)                      # two blocks taken and never given back
    sim.kv.host_tables["ghost"] = []             # a table of a request the scheduler never knew
    sim.add(make_request("a", [1, 2, 3], 2, ignore_eos=True))
    sim.run(20)
    assert sim.all["a"].status == RequestStatus.FINISHED_LENGTH
    assert counts(sim) == (1, 1)
    problems = idle_violations(sim.sched)
    assert any("2 of 16 KV blocks are not free" in p for p in problems), problems
    assert any("2 block(s) keep a ref count" in p for p in problems), problems
    assert any("host_tables remain for request(s) ['ghost']" in p for p in problems), problems


def test_the_block_by_block_part_keeps_to_its_share_of_the_time_and_counts_always_run():
    sim = Sim(CFG, num_blocks=16, block_size=4, check=False)
    sim.add(make_request("a", [1, 2, 3], 2, ignore_eos=True))
    sim.run(20)
    assert sim.core.engine_stats().kv_invariant_full_checks == 1   # the first transition always
    sim.core._full_check_cost = 1e6                                  # as if it had taken very long
    sim.kv.pool.blocks[next(reversed(sim.kv.pool.free))].ref_count += 1
    sim.add(make_request("b", [4, 5], 2, ignore_eos=True))
    sim.run(20)
    s = sim.core.engine_stats()
    assert (s.kv_invariant_checks, s.kv_invariant_full_checks, s.kv_invariant_violations) == (2, 1, 0)
    sim.kv.pool.allocate(1)                                          # a leak the O(1) part sees
    sim.add(make_request("c", [6, 7], 2, ignore_eos=True))
    sim.run(20)
    s = sim.core.engine_stats()
    assert (s.kv_invariant_checks, s.kv_invariant_full_checks, s.kv_invariant_violations) == (3, 1, 1)
