"""Opt-in step traces: one record per engine step, from the real engine or the simulator.

``EngineCore.tracer = StepTracer()`` records, after every step: when it started and how long it
took (by the core's clock: wall time in the engine, simulated time in the simulator), the
batch (sequences, prefill and decode tokens, and the features a step-cost model prices: its
``StepShape``), preemptions and swaps (and the blocks copied), KV usage and the queue lengths.
``conveyor simulate --validate`` prices a real trace's steps with a cost model (sim/validate.py). Saved as JSON (``save``) or as a Chrome / Perfetto trace (``save_chrome``, open it at
ui.perfetto.dev); ``conveyor plot`` draws it. No torch here.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from conveyor.core.stats import EngineStats
from conveyor.scheduler.costs import StepShape
from conveyor.scheduler.output import SchedulerOutput


@dataclass(slots=True)
class StepRecord:
    step: int
    t: float                   # the core's clock when the step started
    dt: float                  # the core's clock time the step took
    num_seqs: int
    prefill_tokens: int
    decode_tokens: int
    preempted: int             # requests preempted in this step (swap or recompute)
    swapped_out: int           # of which swapped out
    swapped_in: int            # requests brought back from host memory
    kv_usage: float            # after the step
    running: int
    waiting: int
    swapped: int
    failed: int = 0            # requests failed with the step (an executor exception)
    seqs: list | None = None   # [[request id, tokens], ...] with detail on
    recomputed: int | None = None   # of the preempted, given back for recomputation (None: preempted - swapped_out)
    shape: dict | None = None  # the plan's StepShape fields (None: a trace written before they were kept)
    swap_blocks: int = 0       # KV blocks copied before the step (out and in)

    def __post_init__(self) -> None:
        if self.recomputed is None:   # a trace written before the field existed: every victim not swapped
            self.recomputed = self.preempted - self.swapped_out


@dataclass
class StepTracer:
    detail: bool = False       # also record which requests ran (for replays; bigger traces)
    records: list[StepRecord] = field(default_factory=list)
    meta: dict = field(default_factory=dict)      # what was traced: engine or simulator, model, config
    timeline: list[float] = field(default_factory=list)   # a driver's clock reads (see sim/harness.py)

    def record(self, plan: SchedulerOutput, t: float, dt: float, before: tuple[int, ...],
               after: tuple[int, ...], stats: EngineStats, failed: int) -> None:
        """`before`/`after`: the scheduler's (preemptions, swaps out, swaps in[, recomputes]) around the step."""
        self.records.append(StepRecord(
            plan.step, t, dt, len(plan.scheduled), plan.num_prefill_tokens, plan.num_decode_tokens,
            after[0] - before[0], after[1] - before[1], after[2] - before[2], stats.kv_usage,
            stats.num_running, stats.num_waiting, stats.num_swapped, failed,
            [[s.request_id, s.num_tokens] for s in plan.scheduled] if self.detail else None,
            after[3] - before[3] if len(after) > 3 else None, asdict(StepShape.of(plan)),
            len(plan.swap_out) + len(plan.swap_in)))

    # ---- files ----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"meta": self.meta, "steps": [asdict(r) for r in self.records], "timeline": self.timeline}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()))

    @classmethod
    def load(cls, path: str | Path) -> StepTracer:
        d = json.loads(Path(path).read_text())
        names = {f.name for f in fields(StepRecord)}
        records = [StepRecord(**{k: v for k, v in r.items() if k in names}) for r in d["steps"]]
        return cls(detail=bool(records and records[0].seqs is not None), records=records, meta=d.get("meta", {}),
                   timeline=d.get("timeline", []))

    def save_chrome(self, path: str | Path) -> None:
        """Chrome trace events: one slice per step, counters for the batch, KV usage and queues."""
        events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 0,
                               "args": {"name": self.meta.get("source", "conveyor")}}]
        t0 = self.records[0].t if self.records else 0.0
        for r in self.records:
            ts = (r.t - t0) * 1e6
            events.append({"name": f"step {r.step}", "cat": "step", "ph": "X", "ts": ts, "dur": r.dt * 1e6,
                           "pid": 0, "tid": 0,
                           "args": {"seqs": r.num_seqs, "prefill_tokens": r.prefill_tokens,
                                    "decode_tokens": r.decode_tokens, "preempted": r.preempted}})
            for name, args in (("batch tokens", {"prefill": r.prefill_tokens, "decode": r.decode_tokens}),
                               ("KV usage", {"used": r.kv_usage}),
                               ("requests", {"running": r.running, "waiting": r.waiting, "swapped": r.swapped})):
                events.append({"name": name, "ph": "C", "ts": ts, "pid": 0, "args": args})
            if r.preempted or r.failed:
                events.append({"name": "preemption" if r.preempted else "failure", "ph": "i", "s": "p",
                               "ts": ts, "pid": 0, "tid": 0,
                               "args": {"preempted": r.preempted, "swapped_out": r.swapped_out,
                                        "recomputed": r.recomputed, "failed": r.failed}})
        Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
