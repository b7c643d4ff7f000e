"""The engine core: the one place where a step happens (schedule -> execute -> update).

The model engine, the simulator and the tests all step through ``EngineCore.step()``; only
the executor (the model runner, a cost model, a fake) and the clock (monotonic or simulated
time) differ. A failing executor fails the requests of its step, not the engine: their KV
blocks are freed and the next step runs as usual. Only ``max_consecutive_failures`` failed
steps in a row, or a failure inside the scheduler itself, mark the core dead.

Before each schedule, requests past their queue deadline fail (scheduler/deadlines.py). When
the last request leaves (the transition to idle), the KV cache must be whole again: that is
checked once then, and a violation is logged and counted, never raised.

A step returns one ``SeqUpdate`` per sequence that changed: what the step added (a token, its
logprobs, a finish), never what was sent before -- the front end keeps the rest. The core calls
each concept's owner through a narrow interface: structured outputs (``GrammarBackend.step_masks``
/ ``accept``), prompt logprobs (scheduler/prompt_logprobs.py), pooling (scheduler/pooling.py);
whether a request finishes is decided in scheduler/stopping.py. No torch here.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Protocol

import msgspec

from conveyor.core.stats import CoreStats, EngineStats
from conveyor.core.trace import StepTracer
from conveyor.request import Request, RequestMetrics, RequestStatus
from conveyor.scheduler.deadlines import QUEUE_TIMEOUT
from conveyor.scheduler.output import LogprobEntry, ModelOutput, SchedulerOutput
from conveyor.scheduler.pooling import collect as collect_embeddings
from conveyor.scheduler.prompt_logprobs import collect as collect_prompt_logprobs
from conveyor.scheduler.prompt_logprobs import first_output as first_prompt_logprobs
from conveyor.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine can no longer run steps (repeated failures, a scheduler fault, or shutdown)."""


class Executor(Protocol):
    """Runs a step's plan: the model runner, the simulator's cost model, the tests' fake."""

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copy KV blocks device -> host (swap_out: (device, host)), then host -> device."""

    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        """Compute the plan's tokens and sample one token per sequence whose ``sample`` is set (by request id)."""


class SeqUpdate(msgspec.Struct, array_like=True):
    """What one step changed for one sequence (a delta, keyed by its id): a new token, a finish, or
    both; or an error. Nothing sent before is sent again. It crosses the process pipe (wire.py) as an
    array of its fields in this order (there is one per sequence per step): a field is only ever added
    at the end, with a default."""

    seq_id: str                        # the sequence (the core's Request.request_id); not the caller's request id
    token_id: int | None
    logprobs: LogprobEntry | None      # the new token's (params.logprobs)
    finish_reason: str | None          # "stop", "length" or "error" once finished
    stop_reason: int | str | None
    error: str | None
    metrics: RequestMetrics | None     # with the first token and the finish only (not resent every step)
    prompt_logprobs: list[LogprobEntry | None] | None = None   # with the first token: the prompt's (first entry None)
    embedding: list[float] | None = None  # an embedding request's result (it finishes with it)
    error_code: str | None = None         # with error: what kind ("queue_timeout"; None: the step failed)
    token_time: float | None = None       # with token_id: when it was sampled (the core's clock)
    # Speculative decoding: accepted tokens that came before token_id in this step, oldest first, and
    # their logprob entries (with logprobs); the sequence is these, then token_id.
    prev_token_ids: list[int] | None = None
    prev_logprobs: list[LogprobEntry] | None = None


def metrics_snapshot(r: Request) -> RequestMetrics:
    """A copy of a request's metrics: the front end keeps its own (it may be in this process)."""
    m = r.metrics
    return dataclasses.replace(m, inter_token_latencies=list(m.inter_token_latencies),
                               preemption_times=list(m.preemption_times))


def _metrics_delta(r: Request, new: int = 1) -> RequestMetrics | None:
    """A sequence's metrics go out with its first token and with its finish: in between they would
    resend a growing list of inter-token latencies every step (each delta carries its token's time).
    (`new`: the tokens this step added.)"""
    return metrics_snapshot(r) if r.num_output_tokens == new or r.is_finished else None


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
        self.tracer: StepTracer | None = None   # opt-in per-step records (core/trace.py)
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

    def abort_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                       reason: int | str | None = None) -> list[Request]:
        """End live requests from outside the step: the caller aborted them, or the front end found a
        stop string in their text (status FINISHED_STOPPED, reason: the string). Unknown ids are
        ignored; returns the requests it ended."""
        ended = []
        for rid in request_ids:
            request = self.scheduler.requests.get(rid)
            if request is not None:
                self.scheduler.finish_request(request, status, reason)
                ended.append(request)
        self._check_if_idle()
        return ended

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
        spec = self.scheduler.speculator
        if spec is not None:
            began, generated = self.clock(), self.scheduler.stats.generation_tokens_total
        try:
            updates = self._step()
        finally:
            self.stats.last_step_time = time.perf_counter() - t0
        plan = self.last_plan
        if spec is not None and plan is not None and plan.scheduled and not plan.num_prefill_tokens:
            # what a decode step of this size costs here, whole (what its drafts are weighed against)
            spec.observe_step(plan.num_tokens, self.clock() - began,
                              self.scheduler.stats.generation_tokens_total - generated)
        self._check_if_idle()
        if tracer is not None and self.last_plan is not None and not self.last_plan.is_empty:
            failed = sum(1 for u in updates if u.error is not None and u.error_code is None)
            tracer.record(self.last_plan, start, self.clock() - start, before, self._preemption_counts(),
                          self.engine_stats(), failed)
        return updates

    def _preemption_counts(self) -> tuple[int, int, int, int]:
        s = self.scheduler.stats
        return s.num_preemptions, s.num_swaps_out, s.num_swaps_in, s.num_recomputes

    def _step(self) -> list[SeqUpdate]:
        try:
            expired = self.scheduler.expire_queued(self.clock())
        except Exception as e:   # noqa: BLE001 - the scheduler's state can no longer be trusted
            return self._die("the scheduler failed", e)
        timeouts = [SeqUpdate(r.request_id, None, None, "error", None, r.error, metrics_snapshot(r),
                              error_code=QUEUE_TIMEOUT)
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
        requests = self.scheduler.requests
        if self.grammars is not None:
            try:
                self.grammars.step_masks(plan, requests)
            except Exception as e:   # noqa: BLE001
                return self._step_failed("computing structured-output masks failed", e, scheduled)
        model_out = ModelOutput()
        if plan.scheduled:
            try:
                model_out = self.executor.execute(plan)
                expected = {s.request_id for s in plan.scheduled if s.sample}
                if model_out.sampled.keys() != expected:
                    raise RuntimeError(f"the executor returned {len(model_out.sampled)} tokens for "
                                       f"{len(expected)} sampling sequences (or for other requests)")
            except Exception as e:   # noqa: BLE001 - fail this step's requests, keep serving
                return self._step_failed("the forward pass or sampling failed", e, scheduled)
        self.stats.consecutive_step_failures = 0
        collect_prompt_logprobs(model_out.prompt_logprobs, requests)
        embeddings = collect_embeddings(model_out.embeddings, requests)
        if self.grammars is not None:
            self.grammars.accept({s.request_id: model_out.step_tokens(s) for s in plan.scheduled
                                  if s.request_id in model_out.sampled}, requests)
        try:
            touched = self.scheduler.update(plan, model_out)   # finishes what is done (scheduler/stopping.py)
        except Exception as e:   # noqa: BLE001
            return self._die("the scheduler's update failed", e)
        return self._updates(model_out, touched) + self._embedded(embeddings)

    @staticmethod
    def _updates(model_out: ModelOutput, touched: list[tuple[Request, int]]) -> list[SeqUpdate]:
        logprobs = model_out.logprobs or {}
        updates = []
        for r, n in touched:
            entry = logprobs.get(r.request_id)
            u = SeqUpdate(r.request_id, r.all_token_ids[-1], entry, r.finish_reason, r.stop_reason, None,
                          _metrics_delta(r, n), first_prompt_logprobs(r), token_time=r.metrics.last_token_time)
            drafted = (model_out.draft_logprobs or {}).get(r.request_id)
            if n > 1:   # speculative tokens accepted before it (a finish may have cut the list short)
                u.prev_token_ids = r.all_token_ids[-n:-1]
            if drafted and entry is not None:   # the entries of its accepted drafts, then the sampled one's
                entries = drafted + [entry]
                u.logprobs, u.prev_logprobs = entries[n - 1], entries[:n - 1] or None
            updates.append(u)
        return updates

    def _embedded(self, embeddings: dict[str, Request]) -> list[SeqUpdate]:
        """The embedding requests this step finished, each with its vector."""
        return [SeqUpdate(rid, None, None, r.finish_reason, None, None, metrics_snapshot(r), embedding=vector)
                for rid, (r, vector) in embeddings.items() if r.is_finished]

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
        return [SeqUpdate(r.request_id, None, None, "error", None, message, metrics_snapshot(r))
                for r in failed]

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

    def engine_stats(self) -> EngineStats:
        """A typed snapshot of the scheduler's, KV cache's and this core's counters."""
        return EngineStats.of(self.scheduler, self.stats, self.dead)


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
