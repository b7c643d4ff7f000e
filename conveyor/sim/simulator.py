"""Discrete-event simulation: the real Scheduler and KV manager, a cost-model executor.

The simulation steps through the same ``EngineCore.step()`` as the engine; only the executor
and the clock differ. The executor "runs" a step in modelled time instead of calling a
model (step time = ``base + per_token * tokens + per_context * sum(context of decodes) +
per_seq * seqs``, added to a simulated clock that the scheduler reads for its timestamps),
and each request emits EOS after its predetermined output length. Everything else —
admission, preemption, chunking, prefix caching — is the production code path, so policies
can be compared on thousands of requests in seconds. No torch here.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from conveyor.engine.core import EngineCore
from conveyor.kv.manager import KVCacheManager
from conveyor.request import Request
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler.config import SchedulerConfig
from conveyor.scheduler.output import ModelOutput, SchedulerOutput
from conveyor.scheduler.scheduler import Scheduler

EOS = 0
IDLE_STEP_S = 1e-3   # simulated time that passes when a step computes nothing


class SimClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        self.now += dt


@dataclass(slots=True)
class CostModel:
    """Seconds per step; defaults roughly fit SmolLM2-135M fp32 on 2 CPU cores."""

    base: float = 0.010
    per_token: float = 0.0035
    per_context: float = 2.0e-6
    per_seq: float = 0.0002

    def step_time(self, out: SchedulerOutput) -> float:
        ctx = sum(s.num_computed_tokens for s in out.scheduled if s.num_tokens == 1)
        return (self.base + self.per_token * out.num_tokens + self.per_context * ctx
                + self.per_seq * len(out.scheduled))


class CostModelExecutor:
    """An Executor that advances the clock by the modelled step time and emits each request's
    predetermined output: EOS as output token number ``output_lengths[request id]``, else 1."""

    def __init__(self, cost: CostModel, clock: SimClock):
        self.cost = cost
        self.clock = clock
        self.output_lengths: dict[str, int] = {}

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        pass   # its cost is not modelled yet

    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        self.clock.advance(self.cost.step_time(plan))
        return ModelOutput([EOS if s.sampling.num_output_tokens + 1 >= self.output_lengths[s.request_id] else 1
                            for s in plan.scheduled if s.sampling is not None])


@dataclass(slots=True)
class SimRequest:
    arrival: float
    prompt_len: int
    output_len: int           # true length: EOS is emitted as token number output_len
    max_tokens: int
    priority: int = 0


@dataclass(slots=True)
class SimResult:
    sim_time: float
    steps: int
    output_tokens: int
    stats: dict
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.sim_time

    def summary(self) -> dict:
        return {"sim_time_s": self.sim_time, "steps": self.steps, "output_tok_s": self.throughput,
                "mean_ttft_s": statistics.mean(self.ttft), "p99_ttft_s": _p99(self.ttft),
                "mean_e2e_s": statistics.mean(self.e2e), "num_preemptions": self.stats["num_preemptions"],
                "recomputed_prompt_tokens": self.stats["prompt_tokens_total"] - self.stats["_first_prompt_tokens"],
                "admission_deferrals": self.stats["admission_deferrals"]}


def _p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))]


def simulate(workload: list[SimRequest], config: SchedulerConfig, num_blocks: int, block_size: int = 16,
             num_host_blocks: int = 0, cost: CostModel | None = None, max_steps: int = 10_000_000) -> SimResult:
    clock = SimClock()
    executor = CostModelExecutor(cost or CostModel(), clock)
    kv = KVCacheManager(num_blocks, block_size, num_host_blocks, enable_prefix_caching=False)
    core = EngineCore(Scheduler(config, kv), executor, clock)
    pending = sorted(workload, key=lambda r: r.arrival)
    steps, nxt = 0, 0
    ttft, e2e = [], []
    started: set[str] = set()
    first_prompt_tokens = sum(r.prompt_len for r in workload)
    while nxt < len(pending) or core.has_unfinished():
        while nxt < len(pending) and pending[nxt].arrival <= clock.now:
            r = pending[nxt]
            params = SamplingParams(temperature=0, max_tokens=r.max_tokens)
            params.eos_token_ids = (EOS,)
            req = Request(str(nxt), [1 + (i % 1000) for i in range(r.prompt_len)], params,
                          priority=r.priority, arrival_time=r.arrival)
            executor.output_lengths[req.request_id] = r.output_len
            core.add_request(req)
            nxt += 1
        if not core.has_unfinished():
            clock.now = pending[nxt].arrival
            continue
        updates = core.step()
        steps += 1
        if steps > max_steps:
            raise RuntimeError("simulation did not finish")
        if not core.last_plan.scheduled:   # nothing computed (a swap-only step costs no modelled time yet)
            clock.advance(IDLE_STEP_S)
        for u in updates:
            if u.token_id is not None and u.request_id not in started:
                started.add(u.request_id)
                ttft.append(u.metrics.ttft)
            if u.finish_reason is not None:
                e2e.append(u.metrics.e2e)
    stats = core.stats_dict()
    stats["_first_prompt_tokens"] = first_prompt_tokens
    return SimResult(clock.now, steps, stats["generation_tokens_total"], stats, ttft, e2e)
