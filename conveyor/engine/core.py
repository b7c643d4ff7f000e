"""The engine core: the one place where a step happens (schedule -> execute -> update).

The model engine, the simulator and the tests all step through ``EngineCore.step()``; only
the executor (the model runner, a cost model, a fake) and the clock (monotonic or simulated
time) differ. A failing executor fails the requests of its step, not the engine: their KV
blocks are freed and the next step runs as usual. Only ``max_consecutive_failures`` failed
steps in a row, or a failure inside the scheduler itself, mark the core dead.

Before each schedule, requests past their queue deadline fail (scheduler/deadlines.py). When
the last request leaves (the transition to idle), the KV cache must be whole again: that is
checked once then, and a violation is logged and counted, never raised.
No torch here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from conveyor.engine.trace import StepTracer
from conveyor.request import Request, RequestMetrics, RequestStatus
from conveyor.scheduler.deadlines import QUEUE_TIMEOUT
from conveyor.scheduler.output import ModelOutput, SchedulerOutput
from conveyor.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine can no longer run steps (repeated failures, a scheduler fault, or shutdown)."""


class Executor(Protocol):
    """Runs a step's plan: the model runner, the simulator's cost model, the tests' fake."""

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copy KV blocks device -> host (swap_out: (device, host)), then host -> device."""

    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        """Compute the plan's tokens and sample one token per sequence whose ``sampling`` is set."""


@dataclass(slots=True)
class SeqUpdate:
    """What happened to one sequence in a step: a new token, a finish, or both; or an error."""

    request_id: str
    token_id: int | None
    logprobs: dict[int, float] | None
    finish_reason: str | None          # "stop", "length" or "error" once finished
    stop_reason: int | str | None
    error: str | None
    metrics: RequestMetrics
    prompt_logprobs: list | None = None   # with the first token: the prompt's logprobs (first entry None)
    embedding: list[float] | None = None  # an embedding request's result (it finishes with it)
    error_code: str | None = None         # with error: what kind ("queue_timeout"; None: the step failed)


@dataclass(slots=True)
class CoreStats:
    step_failures: int = 0             # steps whose executor raised
    consecutive_step_failures: int = 0
    last_step_time: float = 0.0        # seconds in the latest step()
    kv_invariant_checks: int = 0       # KV cache checks on the transition to idle
    kv_invariant_full_checks: int = 0  # of which block by block (see EngineCore.idle_check_share)
    kv_invariant_violations: int = 0   # of which found the cache not whole (a leak or a corrupt block)


def embed(request: Request) -> list[float]:
    """The L2-normalised embedding of a finished embedding request."""
    v = request.pooled / request.num_prompt_tokens if request.params.pooling == "mean" else request.pooled
    return (v / v.norm().clamp_min(1e-12)).tolist()


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor, clock: Callable[[], float] = time.monotonic,
                 max_consecutive_failures: int = 3):
        assert max_consecutive_failures >= 1
        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock
        scheduler.clock = clock
        self.max_consecutive_failures = max_consecutive_failures
        self.stats = CoreStats()
        self.dead_reason: str | None = None
        self.last_plan: SchedulerOutput | None = None
        self.tracer: StepTracer | None = None   # opt-in per-step records (engine/trace.py)
        self.grammars = None   # structured outputs: a sampling.structured.GrammarBackend, set by the engine
        self._busy = False     # requests came since the last idle check
        # The O(blocks) part of the idle check (every block's ref count, check_invariants) may take at
        # most this share of the wall time (None: on every transition); the O(1) part always runs.
        self.idle_check_share: float | None = 0.01
        self._full_check_end, self._full_check_cost = float("-inf"), 0.0

    @property
    def dead(self) -> bool:
        return self.dead_reason is not None

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if self.dead:
            raise EngineDeadError(self.dead_reason)
        self.scheduler.add_request(request)
        self._busy = True

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.scheduler.abort_request(rid)
        self._check_if_idle()

    def finish_request(self, request_id: str, status: RequestStatus, reason: int | str | None = None) -> None:
        """Finish a live request from outside the step (a stop string found in its text)."""
        request = self.scheduler.requests.get(request_id)
        if request is not None:
            self.scheduler.finish_request(request, status, reason)
        self._check_if_idle()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[SeqUpdate]:
        """One iteration; an update for every sequence that got a token, finished or failed."""
        if self.dead:
            raise EngineDeadError(self.dead_reason)
        t0 = time.perf_counter()
        tracer = self.tracer
        if tracer is not None:
            start, before = self.clock(), self._preemption_counts()
        try:
            updates = self._step()
        finally:
            self.stats.last_step_time = time.perf_counter() - t0
        self._check_if_idle()
        if tracer is not None and self.last_plan is not None and not self.last_plan.is_empty:
            failed = sum(1 for u in updates if u.error is not None and u.error_code is None)
            tracer.record(self.last_plan, start, self.clock() - start, before, self._preemption_counts(),
                          self.scheduler.stats_dict(), failed)
        return updates

    def _preemption_counts(self) -> tuple[int, int, int, int]:
        s = self.scheduler.stats
        return s.num_preemptions, s.num_swaps_out, s.num_swaps_in, s.num_recomputes

    def _step(self) -> list[SeqUpdate]:
        try:
            expired = self.scheduler.expire_queued(self.clock())
        except Exception as e:   # noqa: BLE001 - the scheduler's state can no longer be trusted
            return self._die("the scheduler failed", e)
        timeouts = [SeqUpdate(r.request_id, None, None, "error", None, r.error, r.metrics, error_code=QUEUE_TIMEOUT)
                    for r in expired]
        return timeouts + self._schedule_and_run()

    def _schedule_and_run(self) -> list[SeqUpdate]:
        try:
            plan = self.scheduler.schedule()
        except Exception as e:   # noqa: BLE001 - the scheduler's state can no longer be trusted
            return self._die("the scheduler failed", e)
        self.last_plan = plan
        if plan.is_empty:
            return []
        scheduled = [s.request_id for s in plan.scheduled]
        # The swap copies go first: the swapped-out requests' device blocks are already released,
        # so their KV must reach the host before anything else of the step can fail.
        if plan.has_swaps:
            try:
                self.executor.swap(plan.swap_out, plan.swap_in)
            except Exception as e:   # noqa: BLE001 - fail this step's requests, keep serving
                return self._step_failed("a KV swap copy failed", e, scheduled + plan.swapped_out_ids)
        if self.grammars is not None:
            try:
                self._grammar_masks(plan)
            except Exception as e:   # noqa: BLE001
                return self._step_failed("computing structured-output masks failed", e, scheduled)
        model_out = ModelOutput([])
        if plan.scheduled:
            try:
                model_out = self.executor.execute(plan)
                expected = sum(1 for s in plan.scheduled if s.sampling is not None)
                if len(model_out.token_ids) != expected:
                    raise RuntimeError(f"the executor returned {len(model_out.token_ids)} tokens for "
                                       f"{expected} sampling sequences")
            except Exception as e:   # noqa: BLE001 - fail this step's requests, keep serving
                return self._step_failed("the forward pass or sampling failed", e, scheduled)
        self.stats.consecutive_step_failures = 0
        if model_out.prompt_logprobs:
            for rid, entries in model_out.prompt_logprobs.items():
                request = self.scheduler.requests.get(rid)
                if request is not None and request.prompt_logprobs is not None:
                    request.prompt_logprobs.extend(entries)
        embedding = self._pool(model_out.pooled) if model_out.pooled else []
        try:
            touched = self.scheduler.update(plan, model_out)
        except Exception as e:   # noqa: BLE001
            return self._die("the scheduler's update failed", e)
        if self.grammars is not None:
            self._advance_grammars(touched)
        return self._updates(plan, model_out, touched) + [
            SeqUpdate(r.request_id, None, None, r.finish_reason, None, None, r.metrics,
                      embedding=embed(r)) for r in embedding if r.is_finished]

    def _pool(self, pooled: dict) -> list[Request]:
        """Add a step's pooled hidden states to their requests; returns those requests."""
        out = []
        for rid, value in pooled.items():
            request = self.scheduler.requests.get(rid)
            if request is None:
                continue
            mean = request.params.pooling == "mean"
            request.pooled = value if request.pooled is None or not mean else request.pooled + value
            out.append(request)
        return out

    def _grammar_masks(self, plan: SchedulerOutput) -> None:
        """Allowed-token bitmasks of the constrained sequences that sample this step, in one parallel call."""
        requests = self.scheduler.requests
        rows, matchers = [], []
        for i, s in enumerate(x for x in plan.scheduled if x.sampling is not None):
            request = requests.get(s.request_id)
            if request is not None and request.grammar is not None:
                rows.append(i)
                matchers.append(request.grammar)
        if matchers:
            plan.grammar_rows = rows
            plan.grammar_bitmask = self.grammars.fill_bitmasks(matchers)

    def _advance_grammars(self, touched: list[Request]) -> None:
        """Feed each constrained sequence its new token; a completed grammar finishes the request."""
        for r in touched:
            if r.grammar is None or r.is_finished:
                continue
            if not r.grammar.consume_token(r.all_token_ids[-1]):
                logger.warning("request %s: token %d rejected by its grammar (%s); stopping it", r.request_id,
                               r.all_token_ids[-1], r.grammar.get_error())
                self.scheduler.finish_request(r, RequestStatus.FINISHED_STOPPED)
            elif r.grammar.is_stopped():   # nothing but the end can follow
                self.scheduler.finish_request(r, RequestStatus.FINISHED_STOPPED)

    @staticmethod
    def _updates(plan: SchedulerOutput, model_out: ModelOutput, touched: list[Request]) -> list[SeqUpdate]:
        logprobs: dict[str, dict[int, float] | None] = {}
        if model_out.logprobs is not None:
            sampled = (s.request_id for s in plan.scheduled if s.sampling is not None)
            logprobs = dict(zip(sampled, model_out.logprobs))
        return [SeqUpdate(r.request_id, r.all_token_ids[-1], logprobs.get(r.request_id),
                          r.finish_reason, r.stop_reason, None, r.metrics,
                          r.prompt_logprobs if r.num_output_tokens == 1 else None) for r in touched]

    def _step_failed(self, what: str, error: Exception, request_ids: list[str]) -> list[SeqUpdate]:
        s = self.stats
        s.step_failures += 1
        s.consecutive_step_failures += 1
        message = f"{what}: {type(error).__name__}: {error}"
        logger.error("step failed, failing its %d request(s): %s", len(request_ids), message, exc_info=error)
        updates = self._fail(request_ids, message)
        if s.consecutive_step_failures >= self.max_consecutive_failures:
            updates += self._die(f"{s.consecutive_step_failures} consecutive steps failed, the last with: "
                                 f"{message}", None)
        return updates

    def _fail(self, request_ids: list[str], message: str) -> list[SeqUpdate]:
        failed = self.scheduler.fail_requests(request_ids, message)
        return [SeqUpdate(r.request_id, None, None, "error", None, message, r.metrics) for r in failed]

    def _die(self, what: str, error: Exception | None) -> list[SeqUpdate]:
        """Mark the core dead and fail every live request."""
        reason = what if error is None else f"{what}: {type(error).__name__}: {error}"
        if error is not None:
            logger.error("engine core failed: %s", reason, exc_info=error)
        self.dead_reason = reason
        live = list(self.scheduler.requests)
        try:
            return self._fail(live, f"the engine stopped: {reason}")
        except Exception:   # noqa: BLE001 - the state is broken; report the requests anyway
            logger.exception("could not release the requests of a dead engine")
            return [SeqUpdate(rid, None, None, "error", None, f"the engine stopped: {reason}",
                              RequestMetrics(0.0)) for rid in live]

    # ---- the leak check on the transition to idle ------------------------------------------------
    def _check_if_idle(self) -> None:
        """Once per transition to idle (the last request just left): check that the KV cache is whole.

        A violation is a bug somewhere (a leaked block, a ref count off, a request's table left
        behind): it is logged with what was found and counted (/metrics), and the engine goes on
        serving -- the next requests may well be fine, and crashing would fail them all.

        It runs inside the step that emptied the engine, before that step's outputs go out, so
        its cost is latency: the block-by-block part (~1 ms per 1,000 blocks on a slow CPU) is
        skipped while its last run took more than `idle_check_share` of the time since.
        """
        if not self._busy or self.scheduler.has_unfinished():
            return
        self._busy = False
        self.stats.kv_invariant_checks += 1
        start = time.perf_counter()
        share = self.idle_check_share
        full = share is None or start - self._full_check_end >= self._full_check_cost / share
        try:
            problems = idle_violations(self.scheduler, full)
        except Exception as e:   # noqa: BLE001 - a state so broken that checking it raises
            problems = [f"the check itself raised {type(e).__name__}: {e}"]
        if full:
            self._full_check_end = time.perf_counter()
            self._full_check_cost = self._full_check_end - start
            self.stats.kv_invariant_full_checks += 1
        if problems:
            self.stats.kv_invariant_violations += 1
            logger.error("KV cache invariant violated on the transition to idle: %s", "; ".join(problems))

    def stats_dict(self) -> dict:
        d = self.scheduler.stats_dict()
        s = self.stats
        d.update(step_failures=s.step_failures, consecutive_step_failures=s.consecutive_step_failures,
                 last_step_time=s.last_step_time, engine_dead=self.dead, kv_invariant_checks=s.kv_invariant_checks,
                 kv_invariant_full_checks=s.kv_invariant_full_checks,
                 kv_invariant_violations=s.kv_invariant_violations)
        return d


def idle_violations(scheduler: Scheduler, full: bool = True) -> list[str]:
    """What is wrong with the KV cache and the queues of a scheduler without requests (empty: nothing).

    Explicit checks, so that they hold under ``python -O`` too: counts and leftover tables
    (O(1)), then with `full` every block's ref count and the manager's own ``check_invariants``
    (asserts) for the finer structure (O(blocks)).
    """
    kv, problems = scheduler.kv, []
    if kv.num_free_blocks != kv.num_blocks:
        problems.append(f"{kv.num_blocks - kv.num_free_blocks} of {kv.num_blocks} KV blocks are not free "
                        f"with no request left")
    if kv.num_free_host_blocks != kv.num_host_blocks:
        problems.append(f"{kv.num_host_blocks - kv.num_free_host_blocks} of {kv.num_host_blocks} host swap "
                        f"blocks are not free")
    for name in ("tables", "host_tables", "swapped_tables", "hashes", "num_registered", "chain_parent"):
        left = getattr(kv, name, None)
        if left:
            problems.append(f"KV {name} remain for request(s) {sorted(left)[:5]}")
    if scheduler.running or scheduler.swapped or len(scheduler.waiting):
        problems.append(f"queues not empty: {len(scheduler.running)} running, {len(scheduler.swapped)} swapped, "
                        f"{len(scheduler.waiting)} waiting")
    if not full:
        return problems
    referenced = [b.block_id for b in kv.pool.blocks if b.ref_count != 0]
    if referenced:
        problems.append(f"{len(referenced)} block(s) keep a ref count, e.g. block {referenced[0]} "
                        f"(ref {kv.ref_count(referenced[0])})")
    try:
        kv.check_invariants(set())
    except AssertionError as e:
        problems.append(f"check_invariants: {str(e) or 'assertion failed'}")
    return problems
