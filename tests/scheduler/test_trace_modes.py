"""Step traces split each step's preemptions by mode (swapped out vs recomputed); older traces without
the `recomputed` field still load."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from conveyor.core.trace import StepTracer
from conveyor.scheduler.config import SchedulerConfig
from test_scheduler_props import Sim, make_request


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_each_step_records_swapped_and_recomputed_victims(mode, tmp_path):
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, preemption_mode=mode,
                          admission_policy="optimistic", min_resident_steps=1)
    sim = Sim(cfg, num_blocks=8, block_size=4, num_host_blocks=16)
    sim.core.tracer = StepTracer()
    for i in range(4):
        sim.add(make_request(f"r{i}", [1 + i] * 5, 12, ignore_eos=True, seed=i))
    sim.run(500)
    s, records = sim.core.engine_stats(), sim.core.tracer.records
    assert s.num_preemptions > 0
    assert all(r.preempted == r.swapped_out + r.recomputed for r in records)
    assert sum(r.recomputed for r in records) == s.num_recomputes
    assert sum(r.swapped_out for r in records) == s.num_swaps_out
    assert (s.num_swaps_out if mode == "swap" else s.num_recomputes) == s.num_preemptions
    path = tmp_path / "trace.json"
    sim.core.tracer.save(path)
    assert [asdict(r) for r in StepTracer.load(path).records] == [asdict(r) for r in records]
    # A trace written before the field existed: every victim not swapped out was recomputed.
    d = json.loads(path.read_text())
    for step in d["steps"]:
        del step["recomputed"]
    path.write_text(json.dumps(d))
    assert [r.recomputed for r in StepTracer.load(path).records] == [r.recomputed for r in records]
