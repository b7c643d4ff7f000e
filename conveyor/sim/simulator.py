"""Discrete-event simulation: the real Scheduler and KV manager, a cost-model executor.

The simulation steps through the same ``EngineCore.step()`` as the engine, driven by the same
harness (harness.py); only the executor and the clock differ. The executor "runs" a step in
modelled time instead of calling a model: it advances a simulated clock by the cost model's
step time (scheduler/costs.py: fitted on this machine by ``conveyor profile``; roofline.py: a named GPU),
and each request emits EOS after its predetermined output length. Everything else —
admission, preemption, chunking, prefix caching, speculative decoding's choice of drafts — is
the production code path, so policies can be compared on thousands of requests in seconds. With
speculation the executor draws how many drafts the model accepts from the workload's acceptance
distribution (speculation.py). No torch here.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from conveyor.core.engine_core import EngineCore
from conveyor.core.stats import EngineStats
from conveyor.core.trace import StepTracer
from conveyor.kv.manager import KVCacheManager
from conveyor.routing import Router
from conveyor.scheduler.config import SchedulerConfig
from conveyor.scheduler.costs import AfterPrefill, CostModel, StepCostModel, StepShape, preemption_costs
from conveyor.scheduler.fairness import TokenWeights
from conveyor.scheduler.output import ModelOutput, SchedulerOutput
from conveyor.scheduler.scheduler import Scheduler
from conveyor.sim.harness import EOS, OracleLengths, Replica, RequestRecord, drive
from conveyor.sim.speculation import SimSpeculation, make_speculator, spec_summary
from conveyor.sim.workload import TOKEN_RANGE, SimRequest
from conveyor.spec.speculator import SpeculativeConfig

__all__ = ["EOS", "SimClock", "CostModelExecutor", "SimRequest", "SimResult", "simulate", "replay",
           "StepCostModel", "percentile", "elasticity"]


class SimClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        self.now += dt

    def wait_until(self, t: float) -> None:
        self.now = max(self.now, t)


def step_shape(plan: SchedulerOutput) -> StepShape:
    """The plan's shape as the runner computes it (a speculative verification as k + 1 decodes:
    ``StepShape.of``)."""
    return StepShape.of(plan)


class CostModelExecutor:
    """An Executor that advances the clock by the modelled time and emits each request's
    predetermined output (EOS at its oracle length); with `speculation`, drafts are accepted as
    the workload's acceptance distribution draws them (speculation.py)."""

    def __init__(self, cost: CostModel, clock: SimClock, oracle: OracleLengths,
                 speed: Callable[[float], float] | None = None, speculation: SimSpeculation | None = None):
        self.cost, self.clock, self.oracle = cost, clock, oracle
        self.speed = speed   # the machine's slowness over time: a step starting at t takes speed(t) x the model's
        self.after_prefill = AfterPrefill()   # decode steps after a prefill chunk cost more (cost.py)
        self.speculation = speculation

    def _factor(self) -> float:
        if not self.speed:
            return 1.0
        f = self.speed(self.clock.now)
        if not f > 0:
            raise ValueError(f"speed({self.clock.now:.3f}) = {f}: a machine's slowness factor must be positive")
        return f

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        self.clock.advance(self._factor() * (self.cost.swap_time(len(swap_out)) + self.cost.swap_time(len(swap_in))))

    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        shape = step_shape(plan)
        shape_time = getattr(self.cost, "shape_time", None)
        t = shape_time(shape) if shape_time is not None else self.cost.step_time(plan)
        self.clock.advance(self._factor() * (t + self.after_prefill.extra(self.cost, shape.prefill_tokens,
                                                                          shape.tokens)))
        accept = self.speculation.accepted if self.speculation is not None else None
        sampled, accepted = self.oracle.fix_output(
            plan, {s.request_id: EOS + 1 for s in plan.scheduled if s.sample}, accept)
        return ModelOutput(sampled, accepted=accepted or None)


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; NaN for no data."""
    if not xs:
        return math.nan
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


@dataclass
class SimResult:
    records: list[RequestRecord]
    stats: EngineStats                 # the replicas' stats combined
    traces: list[StepTracer] = field(default_factory=list)
    steps: int = 0
    block_size: int = 16
    spec: dict | None = None           # speculative decoding's counters (speculation.spec_summary); None: off

    @property
    def finished(self) -> list[RequestRecord]:
        return [r for r in self.records if r.finish is not None]

    @property
    def start(self) -> float:
        return min((r.arrival for r in self.records), default=0.0)

    @property
    def sim_time(self) -> float:
        """From the first arrival to the last finish."""
        return max((r.finish for r in self.finished), default=self.start) - self.start

    @property
    def output_tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.records)

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.sim_time if self.sim_time > 0 else math.nan

    @property
    def ttft(self) -> list[float]:
        return [r.ttft for r in self.records if r.ttft is not None]

    @property
    def tpot(self) -> list[float]:
        return [r.tpot for r in self.records if r.tpot is not None]

    @property
    def e2e(self) -> list[float]:
        return [r.e2e for r in self.records if r.e2e is not None]

    def meets(self, slo: dict[str, float]) -> bool:
        """Every 'metric_pNN' of the SLO (e.g. ttft_p99: 2.0, tpot_p50: 0.1) at or under its bound."""
        return all(self.metric(name) <= bound for name, bound in slo.items())

    def metric(self, name: str) -> float:
        """'ttft_p99', 'tpot_p50', 'e2e_p90', 'ttft_mean', 'throughput', ..."""
        if name == "throughput":
            return self.throughput
        metric, _, stat = name.partition("_")
        xs = {"ttft": self.ttft, "tpot": self.tpot, "e2e": self.e2e}[metric]
        if stat == "mean":
            return statistics.fmean(xs) if xs else math.nan
        return percentile(xs, float(stat.lstrip("p")))

    def by_tenant(self) -> dict[str, dict[str, float]]:
        """Per tenant: requests, tokens served (prompt + output), its share of them, TTFT mean and p99."""
        groups: dict[str, list[RequestRecord]] = {}
        for r in self.records:
            groups.setdefault(r.tenant, []).append(r)
        total = sum(r.prompt_len + r.num_output_tokens for r in self.finished) or 1
        out = {}
        for tenant, recs in sorted(groups.items()):
            ttft = [r.ttft for r in recs if r.ttft is not None]
            served = sum(r.prompt_len + r.num_output_tokens for r in recs if r.finish is not None)
            out[tenant] = {"requests": len(recs), "tokens": served, "share": served / total,
                           "mean_ttft_s": statistics.fmean(ttft) if ttft else math.nan,
                           "p99_ttft_s": percentile(ttft, 99.0)}
        return out

    def goodput(self, slo: dict[str, float]) -> float:
        """Requests per second that met every per-request bound of the SLO (ttft and tpot bounds)."""
        bounds = {m.partition("_")[0]: b for m, b in slo.items()}
        good = 0
        for r in self.finished:
            ttft, tpot = r.ttft, r.tpot
            if ("ttft" in bounds and ttft > bounds["ttft"]) or ("tpot" in bounds and tpot is not None
                                                                  and tpot > bounds["tpot"]):
                continue
            good += 1
        return good / self.sim_time if self.sim_time > 0 else math.nan

    def kv_usage(self) -> tuple[float, float]:
        """Mean (over steps) and peak KV usage, from the step traces."""
        usage = [r.kv_usage for t in self.traces for r in t.records]
        return (statistics.fmean(usage), max(usage)) if usage else (math.nan, math.nan)

    def summary(self, slo: dict[str, float] | None = None) -> dict:
        s = self.stats
        out = {"requests": len(self.records), "finished": len(self.finished), "sim_time_s": self.sim_time,
               "steps": self.steps, "output_tok_s": self.throughput,
               "req_s": len(self.finished) / self.sim_time if self.sim_time > 0 else math.nan,
               "prefix_cache_hit_rate": self.stats.prefix_cache_hit_rate}
        for m in ("ttft", "tpot", "e2e"):
            out[f"mean_{m}_s"] = self.metric(f"{m}_mean")
            for p in (50, 90, 99):
                out[f"p{p}_{m}_s"] = self.metric(f"{m}_p{p}")
        out.update(num_preemptions=s.num_preemptions, num_swaps_out=s.num_swaps_out,
                   num_recomputes=s.num_recomputes, admission_deferrals=s.admission_deferrals,
                   recomputed_prompt_tokens=s.prompt_tokens_total - sum(r.prompt_len for r in self.records)
                   + s.prefix_cache_hits * self.block_size)
        if self.traces:
            out["mean_kv_usage"], out["peak_kv_usage"] = self.kv_usage()
        if self.spec is not None:
            out.update(self.spec)
        if len({r.tenant for r in self.records}) > 1:
            out["tenants"] = self.by_tenant()
        if slo:
            out["goodput_req_s"] = self.goodput(slo)
            out["slo_met"] = self.meets(slo)
        return out


def make_replica(config: SchedulerConfig, num_blocks: int, block_size: int, num_host_blocks: int,
                 cost: CostModel, prefix_caching: bool, trace: bool, detail: bool = False,
                 speed: Callable[[float], float] | None = None, speculative: SpeculativeConfig | None = None,
                 speculation: SimSpeculation | None = None) -> Replica:
    clock, oracle = SimClock(), OracleLengths()
    kv = KVCacheManager(num_blocks, block_size, num_host_blocks, prefix_caching)
    if speculative is not None and speculation is None:
        speculation = SimSpeculation()
    # as the engine does: the auto mode decides with the cost model's costs (unless the user set them)
    core = EngineCore(Scheduler(config, kv, costs=preemption_costs(config, cost), token_weights=TokenWeights.of(cost)),
                      CostModelExecutor(cost, clock, oracle, speed, speculation if speculative else None), clock)
    if speculative is not None:   # the engine's Speculator, timed by the simulated clock (EngineCore.step)
        core.scheduler.speculator = make_speculator(speculative, speculation, cost)
    if trace:
        core.tracer = StepTracer(detail=detail, meta={"source": "simulator"})
    return Replica(core, oracle, clock, clock.wait_until, getattr(cost, "between_steps", 0.0))


def simulate(workload: list[SimRequest], config: SchedulerConfig, num_blocks: int, block_size: int = 16,
             num_host_blocks: int = 0, cost: CostModel | None = None, *, replicas: int = 1,
             router: str | Router = "least-load", prefix_caching: bool = False, trace: bool = False,
             seed: int = 0, max_steps: int = 50_000_000, speed: Callable[[float], float] | None = None,
             speculative: SpeculativeConfig | dict | str | None = None,
             speculation: SimSpeculation | None = None, max_loras: int = 0) -> SimResult:
    """Run the workload through `replicas` simulated engines (each with its own KV cache of
    num_blocks blocks) behind a router; returns per-request records, stats and optional traces.

    `router`: the data-parallel server's policy (conveyor/routing.py) by name — "prefix",
    "least-load" (alias "least-loaded"), "round-robin" — or a Router. The prefix policy only pays
    with `prefix_caching` on (the CLI's default, as the engine's).

    `speed`: a machine whose speed changes over time — a step (or swap copy) starting at simulated
    time t takes speed(t) times the cost model's time (e.g. `validate.speed_timeline` of a real
    run's trace: what its own machine did, window by window).

    `speculative`: speculative decoding as the engine's --speculative-config (None: off), with
    `speculation` the workload's acceptance distribution and match rate (default: SimSpeculation()
    with this seed).

    `max_loras`: LoRA adapters the engine holds at once (the engine's --max-loras with --enable-lora;
    0: off): the scheduler runs no more at once. Adapters change who may share a step and the
    prefix cache's keys, not the step's cost (the cost model has no LoRA term)."""
    cost = cost or StepCostModel()
    speculative = SpeculativeConfig.parse(speculative)
    if speculative is not None and speculation is None:
        speculation = SimSpeculation(seed=seed)
    reps = [make_replica(config, num_blocks, block_size, num_host_blocks, cost, prefix_caching, trace, speed=speed,
                         speculative=speculative, speculation=speculation)
            for _ in range(replicas)]
    for r in reps:
        r.core.scheduler.max_loras = max_loras
    records = drive(reps, workload, router=router, seed=seed, max_steps=max_steps)
    steps = sum(r.core.scheduler.step for r in reps)
    stats = EngineStats.combine([r.core.engine_stats() for r in reps])
    result = SimResult(records, stats, [r.core.tracer for r in reps if r.core.tracer], steps, block_size)
    if speculative is not None:
        result.spec = spec_summary([r.core.scheduler.speculator for r in reps], result.output_tokens)
    return result


def engine_knobs(engine) -> dict:
    """simulate()'s KV cache and scheduler arguments for a real engine (conveyor.engine.Engine):
    to simulate exactly what it runs."""
    c = engine.config
    return dict(config=c.scheduler, num_blocks=engine.kv.num_blocks, block_size=c.block_size,
                num_host_blocks=engine.kv.num_host_blocks, prefix_caching=c.enable_prefix_caching)


def saturation_rate(workload: list[SimRequest], cost: CostModel, **knobs) -> float:
    """Requests per second the simulated engine completes with the whole workload arriving at once."""
    burst = simulate(workload, cost=cost, **knobs)
    return len(burst.records) / burst.sim_time


SENSITIVITY_METRICS = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "throughput")
SENSITIVITY_STEP = 0.05


def elasticity(metrics_at: Callable[[StepCostModel], dict[str, float]], cost: StepCostModel,
               ref: dict[str, float] | None = None, step: float = SENSITIVITY_STEP) -> dict[str, float]:
    """Per metric, its relative change per relative change of every step cost: the metrics with the
    costs `step` up and `step` down, (up - down) / (2 step) / ref. Near saturation the queue multiplies
    a step-cost error: on a Zen4 VM TPOT p50 moved up to 9.5% per 1% at 80% of capacity, 1.1-2.2% at 30%
    (docs/simulator.md), so a planned metric is only as good as its elasticity times the cost
    model's error on the day. `metrics_at(cost)`: the metrics of the same workload under `cost`;
    `ref`: those under `cost` when already known."""
    ref = ref if ref is not None else metrics_at(cost)
    up, down = metrics_at(cost.scaled(1 + step)), metrics_at(cost.scaled(1 - step))
    return {m: (up[m] - down[m]) / ref[m] / (2 * step) if ref[m] else math.nan for m in ref}


class ReplayClock:
    """The clock reads a real run made, returned in the same order (see replay())."""

    def __init__(self, reads: list[float]):
        self.reads, self.i, self.last = reads, 0, reads[0] if reads else 0.0

    def __call__(self) -> float:
        if self.i >= len(self.reads):
            raise RuntimeError("the replay asked the clock more often than the recorded run: the runs diverged")
        self.last = self.reads[self.i]
        self.i += 1
        return self.last


def replay(timeline: list[float], workload: list[SimRequest], config: SchedulerConfig, num_blocks: int,
           block_size: int = 16, num_host_blocks: int = 0, prefix_caching: bool = True, seed: int = 0,
           token_range: tuple[int, int] = TOKEN_RANGE) -> tuple[list[RequestRecord], StepTracer]:
    """Re-run a recorded engine run in the simulator with its measured timing: the driver reads
    the clock values the real run read, in order, so every arrival joins at the same step; if the
    scheduler is the same, the schedules are identical step by step (the traces say)."""
    clock = ReplayClock(timeline)
    oracle = OracleLengths()
    kv = KVCacheManager(num_blocks, block_size, num_host_blocks, prefix_caching)
    core_clock = lambda: clock.last   # noqa: E731 - timestamps follow the replayed time
    core = EngineCore(Scheduler(config, kv), CostModelExecutor(_Free(), SimClock(), oracle), core_clock)
    core.tracer = StepTracer(detail=True, meta={"source": "replay"})
    records = drive([Replica(core, oracle, clock, lambda t: None)], workload, seed=seed, token_range=token_range)
    return records, core.tracer


class _Free:
    """A cost model whose steps take no time (the replayed clock carries the real times)."""

    def step_time(self, plan: SchedulerOutput) -> float:
        return 0.0

    def swap_time(self, num_blocks: int) -> float:
        return 0.0
