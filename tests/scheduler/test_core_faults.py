"""EngineCore under fire: thousands of random steps with arrivals, aborts, preemptions (swap and
recompute) and injected executor exceptions; the block invariants are checked after every step
(by ``Sim``), and every request that was not failed or aborted still gets exactly its tokens."""

from __future__ import annotations

import random

import pytest

from conveyor.core.engine_core import EngineDeadError
from conveyor.request import RequestStatus
from conveyor.scheduler.config import SchedulerConfig
from conveyor.scheduler.output import ModelOutput
from test_scheduler_props import PREFIXES, VOCAB, Sim, make_request


@pytest.mark.parametrize("seed", range(3))
def test_random_steps_with_faults_keep_every_block_in_one_place(seed):
    rng = random.Random(seed)
    cfg = SchedulerConfig(max_num_seqs=rng.choice([4, 8]), max_num_batched_tokens=rng.choice([16, 48]),
                          preemption_mode=["swap", "auto", "recompute"][seed], admission_policy="optimistic",
                          min_resident_steps=1, long_prefill_token_threshold=rng.choice([0, 8]))
    sim = Sim(cfg, num_blocks=20, block_size=4, num_host_blocks=24, max_consecutive_failures=1 << 30)
    sim.exe.fault = lambda phase: rng.random() < (0.03 if phase == "execute" else 0.15)
    aborted = 0
    for t in range(2000):
        if rng.random() < 0.25:
            plen = rng.randint(1, 30)
            shared = rng.randint(0, plen)
            prompt = PREFIXES[rng.randrange(3)][:shared] + [rng.randint(1, VOCAB - 1) for _ in range(plen - shared)]
            sim.add(make_request(f"r{t}", prompt, rng.randint(1, 40), out_len=rng.choice([None, rng.randint(1, 40)]),
                                 priority=rng.randint(0, 2), seed=t))
        live = list(sim.sched.requests)
        if live and rng.random() < 0.04:
            sim.abort(rng.choice(live))
            aborted += 1
        sim.step()
    sim.exe.fault = lambda phase: False
    sim.run(20_000)
    sim.check_idle()
    sim.check_outputs()
    s = sim.core.engine_stats()
    statuses = [r.status for r in sim.all.values()]
    assert s.step_failures > 10 and statuses.count(RequestStatus.FINISHED_ERROR) > 10
    assert s.num_preemptions > 10 and aborted > 10
    if cfg.preemption_mode != "recompute":
        assert s.num_swaps_out > 0
    assert statuses.count(RequestStatus.FINISHED_STOPPED) + statuses.count(RequestStatus.FINISHED_LENGTH) > 100
    assert not sim.core.dead


def test_consecutive_failures_kill_the_core_and_free_everything():
    cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64)
    sim = Sim(cfg, num_blocks=16, block_size=4, max_consecutive_failures=2)
    for i in range(4):
        sim.add(make_request(f"r{i}", [1 + i] * 6, 10, ignore_eos=True, seed=i))
    sim.exe.fault = lambda phase: True
    sim.step()                      # r0 fails alone
    assert not sim.core.dead and sim.all["r0"].status == RequestStatus.FINISHED_ERROR
    sim.step()                      # r1 fails: the second in a row
    assert sim.core.dead and "2 consecutive steps failed" in sim.core.dead_reason
    assert all(r.status == RequestStatus.FINISHED_ERROR for r in sim.all.values())
    assert "the engine stopped" in sim.all["r3"].error
    sim.check_idle()
    with pytest.raises(EngineDeadError):
        sim.core.step()
    with pytest.raises(EngineDeadError):
        sim.add(make_request("late", [1, 2], 4))


def test_a_success_resets_the_failure_count():
    cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64)
    sim = Sim(cfg, num_blocks=16, block_size=4, max_consecutive_failures=2)
    for i in range(5):
        sim.add(make_request(f"r{i}", [1 + i] * 6, 2, ignore_eos=True, seed=i))
    outcomes = iter([True, False, False, True, False, False, True, False, False])
    sim.exe.fault = lambda phase: next(outcomes, False)
    sim.run(100)
    assert not sim.core.dead and sim.core.stats.step_failures == 3


def test_an_executor_returning_the_wrong_number_of_tokens_fails_its_step():
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    sim = Sim(cfg, num_blocks=16, block_size=4)
    sim.add(make_request("a", [1, 2, 3], 4, ignore_eos=True))
    execute = sim.exe.execute
    sim.exe.execute = lambda plan: ModelOutput({**execute(plan).sampled, "ghost": 7})
    sim.step()
    assert sim.all["a"].status == RequestStatus.FINISHED_ERROR and "returned 2 tokens" in sim.all["a"].error
    sim.check_idle()
