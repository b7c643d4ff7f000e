"""One driver for a workload over engine cores: the simulator's and the real engine's.

``drive()`` feeds timed arrivals to one or more ``EngineCore`` replicas and steps them until all
requests have finished. The same code runs the simulator (each replica with its own simulated
clock, a cost-model executor) and a real engine (the wall clock, the ModelRunner), so the two
differ only in their executor and clock — which is what makes a simulation checkable against
the engine. Requests get their true output length from an oracle (``OracleLengths``): the
executor emits EOS exactly there, whatever the model would have sampled. No torch here.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from conveyor.core.engine_core import EngineCore
from conveyor.core.trace import StepTracer
from conveyor.kv.events import KVEventRecorder
from conveyor.lora.request import LoRARequest, adapter_key
from conveyor.request import Request
from conveyor.routing import Router, replica_load
from conveyor.runner.state import RunnerState
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler.output import ModelOutput, SchedulerOutput
from conveyor.sim.workload import TOKEN_RANGE, SimRequest

EOS = 0
IDLE_STEP_S = 1e-3   # time to wait when a step computes nothing


class OracleLengths:
    """Makes every request end after its true output length: EOS there and only there.

    It follows the plans like a runner does (``RunnerState``) to know how many tokens each
    request has generated: call ``fix`` once per executed plan.

    Speculative decoding: a seq with drafts emits its accepted drafts, then the sampled token. The
    oracle keeps at most the drafts that fit before the request's end (so its last token, EOS, is a
    sampled one, exactly at the oracle length) and records them in its state as the runner does
    (``RunnerState.accept``). Keeping fewer than the model did happens only in the request's last
    step, which ends it: the runner's copy, one ahead, is forgotten with it."""

    def __init__(self) -> None:
        self.lengths: dict[str, int] = {}
        self.state = RunnerState()

    def fix(self, plan: SchedulerOutput, sampled: dict[str, int],
            accept: Callable[[str, int, int], int] | None = None) -> dict[str, int]:
        """The sampled tokens with EOS at each request's end (see ``fix_output``)."""
        return self.fix_output(plan, sampled, accept)[0]

    def fix_output(self, plan: SchedulerOutput, sampled: dict[str, int],
                   accept: Callable[[str, int, int], int] | None = None) -> tuple[dict[str, int], dict[str, int]]:
        """(sampled tokens, accepted drafts per seq that had some). `accept(request id, position of
        its next output token, number of drafts)`: how many drafts the model accepted (None: none)."""
        self.state.apply(plan)
        out, accepted = {}, {}
        for s in plan.scheduled:
            rid = s.request_id
            if rid not in sampled:
                continue
            n = self.state.row(rid).num_output_tokens   # the sampled token (or first draft) is output n + 1
            if s.num_drafts:
                a = accept(rid, n, s.num_drafts) if accept is not None else 0
                a = max(0, min(a, s.num_drafts, self.lengths[rid] - n - 1))
                self.state.accept(rid, a)
                accepted[rid] = a
                n += a
            token = sampled[rid]
            out[rid] = EOS if n + 1 >= self.lengths[rid] else (token if token != EOS else EOS + 1)
        return out, accepted


class OracleExecutor:
    """Wraps an executor (the ModelRunner) so that requests end at their oracle length."""

    def __init__(self, inner, oracle: OracleLengths):
        self.inner, self.oracle = inner, oracle

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        self.inner.swap(swap_out, swap_in)

    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        out = self.inner.execute(plan)
        sampled, accepted = self.oracle.fix_output(plan, out.sampled, lambda rid, n, k: out.num_accepted(rid))
        draft_logprobs = None
        if out.draft_logprobs:
            draft_logprobs = {rid: e[:accepted.get(rid, 0)] for rid, e in out.draft_logprobs.items()
                              if accepted.get(rid, 0)}
        return ModelOutput(sampled, out.logprobs, accepted=accepted or None, draft_logprobs=draft_logprobs or None)


@dataclass
class Replica:
    core: EngineCore
    oracle: OracleLengths
    clock: Callable[[], float]              # the driver's view of this replica's time
    wait_until: Callable[[float], None]     # idle until then (advance a simulated clock, or sleep)
    between_steps: float = 0.0              # simulated: time after each step before the next can start


@dataclass(slots=True)
class RequestRecord:
    index: int
    arrival: float
    prompt_len: int
    output_len: int
    replica: int = 0
    first_token: float | None = None
    finish: float | None = None
    num_output_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    tenant: str = ""

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.finish is None or self.first_token is None or self.num_output_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.num_output_tokens - 1)


def make_request(index: int, spec: SimRequest, arrival: float, seed: int = 0,
                 token_range: tuple[int, int] = TOKEN_RANGE) -> Request:
    params = SamplingParams(temperature=0, max_tokens=spec.cap)
    params.eos_token_ids = (EOS,)
    lora = LoRARequest(f"adapter-{spec.adapter}", spec.adapter, "") if spec.adapter else None
    return Request(str(index), spec.prompt_token_ids(index, seed, token_range), params, priority=spec.priority,
                   arrival_time=arrival, tenant=spec.tenant, lora=lora)


def replica_loads(replicas: list[Replica]) -> list[float | None]:
    """Each replica's load as the data-parallel engine measures it (DataParallelEngine.loads():
    unfinished requests + KV usage as a tie-break); a simulated replica is never down."""
    return [replica_load(len(r.core.scheduler.requests), r.core.scheduler.kv.usage) for r in replicas]


def make_router(router: str | Router, replicas: list[Replica]) -> Router:
    """A policy name ("prefix", "least-load" or its alias "least-loaded", "round-robin") as the
    server builds it (the replicas' block size, the default prefix depth and balance slack); a
    Router is used as given."""
    if isinstance(router, Router):
        return router
    return Router(router, replicas[0].core.scheduler.kv.block_size)


def drive(replicas: list[Replica], workload: list[SimRequest], *, router: str | Router = "least-load", seed: int = 0,
          timeline: list[float] | None = None, max_steps: int = 50_000_000,
          token_range: tuple[int, int] = TOKEN_RANGE) -> list[RequestRecord]:
    """Run the workload to completion; returns one record per request (in workload order).

    Each loop reads every replica's clock once, then either steps the busy replica that is
    furthest behind, if it is behind the next arrival, or hands the next arrival to the router's
    replica (an idle replica first waits for it). With one replica this is: add every request
    that has arrived, then step. `timeline` receives the clock reads of replica 0 (one replica:
    enough to replay the run's exact timing, see conveyor/sim/replay.py). The router is the
    server's policy (conveyor/routing.py), fed the prompt's token ids and the replicas' loads.
    """
    policy = make_router(router, replicas)
    # The prefix router learns what each replica's cache holds from its KV events, as the
    # data-parallel server's does (handed over after each step here; published after it there).
    recorders = [learning_events(r) for r in replicas] if policy.policy == "prefix" and len(replicas) > 1 else None
    t0 = replicas[0].clock()
    if timeline is not None:
        timeline.append(t0)
    order = sorted(range(len(workload)), key=lambda i: workload[i].arrival)
    pending = deque(order)
    records = [RequestRecord(i, t0 + w.arrival, w.prompt_len, w.output_len, tenant=w.tenant)
               for i, w in enumerate(workload)]
    steps = 0
    while pending or any(r.core.has_unfinished() for r in replicas):
        nows = [r.clock() for r in replicas]
        if timeline is not None:
            timeline.append(nows[0])
        busy = [i for i, r in enumerate(replicas) if r.core.has_unfinished()]
        nxt = records[pending[0]].arrival if pending else math.inf
        behind = min(busy, key=lambda i: nows[i], default=None)
        if behind is not None and nows[behind] < nxt:
            _step(replicas[behind], nows[behind], records)
            if recorders is not None and recorders[behind].pending:
                policy.learn(behind, recorders[behind].take())
            steps += 1
            if steps > max_steps:
                raise RuntimeError(f"the run did not finish in {max_steps} steps")
            continue
        index = pending[0]
        spec = workload[index]
        request = make_request(index, spec, records[index].arrival, seed, token_range)
        target = 0 if len(replicas) == 1 else policy.choose(request.prompt_token_ids, replica_loads(replicas),
                                                            request.cache_salt, adapter_key(request.lora))
        replica = replicas[target]
        if not replica.core.has_unfinished() and nows[target] < nxt:
            replica.wait_until(nxt)
            if len(replicas) == 1:
                continue   # read the clock again before adding
        pending.popleft()
        records[index].replica = target
        replica.oracle.lengths[str(index)] = spec.output_len
        replica.core.add_request(request)
    return records


def learning_events(replica: Replica) -> KVEventRecorder:
    """The replica's KV-event recorder (one is attached if it has none)."""
    kv = replica.core.scheduler.kv
    if kv.events is None:
        kv.enable_events(KVEventRecorder(kv.block_size))
    return kv.events


def _step(replica: Replica, now: float, records: list[RequestRecord]) -> None:
    updates = replica.core.step()
    plan = replica.core.last_plan
    if plan is None or not plan.scheduled:
        replica.wait_until(now + IDLE_STEP_S)
    if replica.between_steps and plan is not None and plan.scheduled:   # the tokens are out; then the gap
        replica.wait_until(replica.clock() + replica.between_steps)
    for u in updates:
        rec = records[int(u.seq_id)]
        if u.token_id is not None:
            rec.num_output_tokens += 1 + len(u.prev_token_ids or ())
            if rec.first_token is None:
                rec.first_token = u.metrics.first_token_time
        if u.finish_reason is not None:
            rec.finish, rec.finish_reason = u.metrics.finished_time, u.finish_reason
            rec.num_preemptions = u.metrics.num_preemptions


def run_on_engine(engine, workload: list[SimRequest], *, seed: int = 0, detail: bool = False,
                  timeline: list[float] | None = None) -> tuple[list[RequestRecord], StepTracer]:
    """The workload on a real engine (`conveyor.engine.engine.Engine`), in real time: its core and
    ModelRunner behind the same driver as the simulator, each request ending at its oracle length.
    Returns the records and the run's step trace (the engine's own tracer is put back after)."""
    core = engine.core
    oracle = OracleLengths()
    executor, tracer = core.executor, core.tracer
    core.executor = OracleExecutor(executor, oracle)
    core.tracer = StepTracer(detail=detail, meta={"source": "engine", "model": engine.model_name})
    replica = Replica(core, oracle, time.monotonic, lambda t: time.sleep(max(0.0, t - time.monotonic())))
    vocab = engine.model_config.vocab_size
    try:
        records = drive([replica], workload, seed=seed, timeline=timeline,
                        token_range=(min(TOKEN_RANGE[0], vocab // 2), min(TOKEN_RANGE[1], vocab - 1)))
        return records, core.tracer
    finally:
        core.executor, core.tracer = executor, tracer
