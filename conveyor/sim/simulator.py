"""Discrete-event simulation: the real Scheduler and KV manager, a cost-model executor.

The executor "runs" a step in modelled time instead of calling a model: step time =
``base + per_token * tokens + per_context * sum(context of decodes) + per_seq * seqs``, and each
request emits EOS after its predetermined output length. Everything else — admission,
preemption, chunking, prefix caching — is the production code path, so policies can be
compared on thousands of requests in seconds.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from conveyor.kv.manager import KVCacheManager
from conveyor.request import Request
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler.config import SchedulerConfig
from conveyor.scheduler.output import ModelOutput, SchedulerOutput
from conveyor.scheduler.scheduler import Scheduler

EOS = 0


@dataclass(slots=True)
class CostModel:
    """Seconds per step; defaults roughly fit SmolLM2-135M fp32 on 2 CPU cores."""

    base: float = 0.010
    per_token: float = 0.0035
    per_context: float = 2.0e-6
    per_seq: float = 0.0002

    def step_time(self, out: SchedulerOutput) -> float:
        ctx = sum(s.request.num_computed_tokens for s in out.scheduled if s.num_tokens == 1)
        return (self.base + self.per_token * out.num_tokens + self.per_context * ctx
                + self.per_seq * len(out.scheduled))


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
    cost = cost or CostModel()
    kv = KVCacheManager(num_blocks, block_size, num_host_blocks, enable_prefix_caching=False)
    sched = Scheduler(config, kv)
    pending = sorted(workload, key=lambda r: r.arrival)
    truth: dict[str, int] = {}
    now, steps, nxt = 0.0, 0, 0
    ttft, e2e = [], []
    first_prompt_tokens = sum(r.prompt_len for r in workload)
    while nxt < len(pending) or sched.has_unfinished():
        while nxt < len(pending) and pending[nxt].arrival <= now:
            r = pending[nxt]
            params = SamplingParams(temperature=0, max_tokens=r.max_tokens)
            params.eos_token_ids = (EOS,)
            req = Request(str(nxt), [1 + (i % 1000) for i in range(r.prompt_len)], params,
                          priority=r.priority, arrival_time=r.arrival)
            truth[req.request_id] = r.output_len
            sched.add_request(req)
            nxt += 1
        if not sched.has_unfinished():
            now = pending[nxt].arrival
            continue
        out = sched.schedule()
        steps += 1
        if steps > max_steps:
            raise RuntimeError("simulation did not finish")
        now += cost.step_time(out) if not out.is_empty else 1e-3
        tokens = [EOS if s.request.num_output_tokens + 1 >= truth[s.request.request_id] else 1
                  for s in out.scheduled if s.sample]
        for req in sched.update(out, ModelOutput(tokens)):
            if req.num_output_tokens == 1:
                ttft.append(now - req.arrival_time)
            if req.is_finished:
                e2e.append(now - req.arrival_time)
    stats = sched.stats_dict()
    stats["_first_prompt_tokens"] = first_prompt_tokens
    return SimResult(now, steps, stats["generation_tokens_total"], stats, ttft, e2e)
