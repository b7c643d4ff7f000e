"""EngineStats: a typed snapshot of every counter below it, frozen, picklable, dict only for output."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from conveyor.engine.stats import CoreStats, EngineStats
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
