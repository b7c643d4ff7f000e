"""EngineStats: a typed snapshot of every counter below it, frozen, picklable, dict only for output."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from conveyor.core.stats import CoreStats, EngineStats
from conveyor.kv.manager import KVCacheManager
from conveyor.scheduler.config import SchedulerConfig
from conveyor.scheduler.scheduler import Scheduler, SchedulerStats


def test_every_counter_below_has_a_field():
    names = {f.name for f in dataclasses.fields(EngineStats)}
    assert {f.name for f in dataclasses.fields(SchedulerStats)} <= names
    assert {f.name for f in dataclasses.fields(CoreStats)} <= names


def test_a_snapshot_is_frozen_and_pickles():
    sched = Scheduler(SchedulerConfig(), KVCacheManager(8, 4, 0, True))
    sched.stats.num_preemptions = 3
    s = EngineStats.of(sched, CoreStats(step_failures=1), dead=False)
    sched.stats.num_preemptions = 4   # a snapshot does not follow the live counters
    assert (s.num_preemptions, s.step_failures, s.num_kv_blocks, s.num_free_kv_blocks) == (3, 1, 8, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.num_waiting = 1
    assert pickle.loads(pickle.dumps(s)) == s
    d = s.as_dict()
    assert d["num_preemptions"] == 3 and d["prefix_cache_hit_rate"] == 0.0 and set(d) >= {"kv_usage", "engine_dead"}


def test_requests_are_counted_once_whatever_their_sequences(make_engine):
    """vLLM's running/waiting gauges count requests: an n = 3 request is one, while its sequences
    are three; the counts are kept as sequences come and go (O(1) per step)."""
    from conveyor import SamplingParams

    engine = make_engine(max_num_seqs=4)
    for i in range(3):
        engine.add_request([5 + i] * 6, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.add_request([9] * 6, SamplingParams(temperature=1.0, n=3, max_tokens=8, ignore_eos=True, seed=1))
    assert engine.core.scheduler.counts.live == 4 and len(engine.core.scheduler.requests) == 6
    s = engine.stats()
    assert (s.num_running_requests, s.num_waiting_requests, s.num_waiting) == (0, 4, 6)
    engine.step()
    s = engine.stats()
    assert s.num_running + s.num_waiting == 6 and s.num_running_requests + s.num_waiting_requests == 4
    while engine.has_unfinished_requests():
        engine.step()
    s = engine.stats()
    assert engine.core.scheduler.counts.live == 0
    assert (s.num_running_requests, s.num_waiting_requests, s.num_running, s.num_waiting) == (0, 0, 0, 0)


def test_speculation_counters_are_in_the_snapshot_and_cross_the_wire():
    """The speculator's counters (vLLM's spec-decode metrics) are fields: zeros and no positions while
    speculation is off, a copy of its SpecStats while on; they survive the process wire."""
    from conveyor.core.wire import StepResults, decode_result, encode
    from conveyor.spec.speculator import SpeculativeConfig, Speculator

    sched = Scheduler(SchedulerConfig(), KVCacheManager(8, 4, 0, True))
    off = EngineStats.of(sched, CoreStats(), dead=False)
    assert (off.spec_num_drafts, off.spec_num_draft_tokens, off.spec_num_accepted_tokens) == (0, 0, 0)
    assert off.spec_accepted_per_pos == ()
    sched.speculator = Speculator(SpeculativeConfig(num_speculative_tokens=3))
    assert EngineStats.of(sched, CoreStats(), dead=False).spec_accepted_per_pos == (0, 0, 0)   # on, at 0
    for proposed, accepted in ((3, 2), (2, 0), (3, 3)):
        sched.speculator.observe("r", proposed, accepted)
    sched.stats.spec_rejected_tokens = 3
    s = EngineStats.of(sched, CoreStats(), dead=False)
    sched.speculator.observe("r", 1, 1)   # the snapshot is a copy
    assert (s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens) == (3, 8, 5)
    assert s.spec_accepted_per_pos == (2, 2, 1) and s.spec_rejected_tokens == 3
    got = decode_result(encode(StepResults(updates=[], stats=s, applied_seqs=0)))
    assert got.stats == s and type(got.stats.spec_accepted_per_pos) is tuple
    assert s.as_dict()["spec_accepted_per_pos"] == (2, 2, 1)
