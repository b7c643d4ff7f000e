"""Iteration-level scheduler: one token budget per step, recomposed after every forward pass.

Each step: (1) running decodes; (2) the rest of the budget by rank (priority, then arrival) to
running prefill chunks and to queued requests coming in (swapped ones back, waiting ones
admitted under the admission policy); a queued request that does not fit when its turn comes
may preempt running requests of worse priority. The queue holds waiting and swapped requests in one order, so a preempted request
keeps its place whichever way it was preempted. Every request just moves its
``num_computed_tokens`` toward its length; there is no separate prefill phase.
No torch here: the simulator drives this very class with a cost-model executor.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from conveyor.kv.manager import NO_PREFIX, CachedPrefix, KVCacheManager
from conveyor.request import Request, RequestStatus
from conveyor.scheduler.admission import AdmissionPolicy, make_admission_policy
from conveyor.scheduler.config import SchedulerConfig
from conveyor.scheduler.deadlines import DeadlineHeap, queue_limit, timeout_message
from conveyor.scheduler.output import ModelOutput, NewRequestData, ScheduledSeq, SchedulerOutput
from conveyor.scheduler.preemption import (PreemptionCosts, eligible_victims, order_victims, victim_cost,
                                           victim_key)
from conveyor.scheduler.pooling import chunk_pooling as pooling_of_chunk
from conveyor.scheduler.prompt_logprobs import chunk_targets as prompt_targets
from conveyor.scheduler.prompt_logprobs import reset as reset_prompt_logprobs
from conveyor.scheduler.fairness import FairQueue, TenantLedger, TokenWeights
from conveyor.scheduler.request_counts import RequestCounts
from conveyor.scheduler.stopping import finish_verdict


@dataclass(slots=True)
class SchedulerStats:
    """The scheduler's counters (core/stats.py's EngineStats snapshots them with the KV cache's)."""

    steps: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    step_prefill_tokens: int = 0
    step_decode_tokens: int = 0
    prompt_tokens_total: int = 0          # prefill tokens computed (recomputation included)
    prompt_tokens_started: int = 0        # whole prompts of sequences that produced a first token (vLLM's)
    prompt_tokens_cached: int = 0         # of those, read from the prefix cache at first admission
    generation_tokens_total: int = 0
    num_preemptions: int = 0
    num_swaps_out: int = 0
    num_swaps_in: int = 0
    num_recomputes: int = 0
    num_priority_preemptions: int = 0
    blocks_swapped_out: int = 0           # blocks copied to host by preemption (shared ones stay)
    tokens_recomputed: int = 0            # computed tokens thrown away by recompute preemption
    preemption_cost: float = 0.0          # estimated seconds to bring every victim back
    num_swaps_dropped: int = 0            # swapped requests whose KV was dropped (see _unpin_swapped)
    residency_overrides: int = 0          # growths that had to take a resident victim of their priority
    admission_deferrals: int = 0          # steps in which the policy held the queue head back
    num_finished: int = 0
    num_aborted: int = 0
    num_errors: int = 0
    num_queue_timeouts: int = 0           # failed by their queue deadline before their first scheduling
    spec_rejected_tokens: int = 0         # speculative decoding: draft tokens computed and refused


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, admission: AdmissionPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic, costs: PreemptionCosts | None = None,
                 token_weights: TokenWeights | None = None):
        self.config = config
        # auto preemption: the costs the user set, else the profile's (passed in), else defaults
        self.costs = costs or PreemptionCosts.of(config)
        self.kv = kv
        self.clock = clock   # timestamps: monotonic time in the engine, simulated time in the simulator
        self.admission = admission or make_admission_policy(
            config.admission_policy, config.admission_quantile, config.reservation_buffer,
            config.admission_half_life)
        # Service per tenant (scheduler/fairness.py): equal priorities go to the least served tenant first.
        self.tenants = TenantLedger(config.tenant_weight_map, token_weights, config.tenant_fairness == "vtc",
                                    config.tenant_max_running)
        self.waiting = FairQueue(self.tenants)   # waiting and swapped requests, by (priority, service, arrival)
        self.running: list[Request] = []
        self.swapped: list[Request] = []    # the swapped ones (also in the queue)
        self._reserved: int | None = None
        self.requests: dict[str, Request] = {}
        self.counts = RequestCounts()   # requests (an n > 1 request once) live and running
        self.deadlines = DeadlineHeap(self.requests)   # queue deadlines (deadlines.py)
        self.stats = SchedulerStats()
        self._arrivals = 0
        self.step = 0
        # The runner's view (plans carry deltas): block ids of each request's table it holds, and
        # the requests it must drop, pending until a plan that reaches update() carried them.
        self._sent_blocks: dict[str, int] = {}
        self._forget: list[str] = []
        # Speculative decoding (conveyor/spec/speculator.py): None = off.
        self.speculator = None
        # LoRA: adapters the runner may hold at once (0: LoRA off); the requests it holds (running,
        # swapped) never name more (_lora_fits), counted per adapter id
        self.max_loras = 0
        self._held_loras: dict[int, int] = {}
        self._decoded: list[str] = []   # tenants of the decodes planned and not charged yet

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        need = self.kv.blocks_for(request.num_tokens + 1)
        if need > self.kv.num_blocks:
            raise ValueError(f"request needs {need} KV blocks for its prompt, the whole cache has "
                             f"{self.kv.num_blocks}")
        # Nothing can outgrow the whole cache: cap there so a lone request always fits
        # (else it would preempt itself forever).
        capacity = self.kv.max_tokens
        request.max_model_len = min(request.max_model_len or capacity, capacity)
        if request.arrival_time is None:
            request.arrival_time = request.metrics.arrival_time = self.clock()
        request.arrival_seq = self._arrivals
        self._arrivals += 1
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.counts.added(request)
        self.tenants.arrived(request.tenant)
        self.waiting.push(request)
        self.deadlines.push(request, self.config.max_queue_time)

    def finish_request(self, request: Request, status: RequestStatus, reason: int | str | None = None) -> None:
        """Leave the engine now (stop, length, abort, error); blocks are free for the next step."""
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self.counts.stopped(request)
            self.tenants.stopped(request.tenant)
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        elif request.status == RequestStatus.WAITING:
            self.waiting.discard(request)
        self.kv.free(request)
        self.kv.forget(request)
        self._unsend(request)
        request.finish(status, self.clock(), reason)
        if self.speculator is not None:
            self.speculator.finished(request)
        if self.requests.pop(request.request_id, None) is not None:
            self.counts.removed(request)
            self.tenants.left(request.tenant)
        if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            if request.params.pooling is None:   # an embedding's zero output says nothing of generation lengths
                self.admission.observe(request)
            self.stats.num_finished += 1
        elif status == RequestStatus.FINISHED_ABORTED:
            self.stats.num_aborted += 1
        else:
            self.stats.num_errors += 1

    def fail_requests(self, request_ids: list[str], message: str) -> list[Request]:
        """Finish these requests with an error (their step failed); returns the ones still live."""
        failed = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                req.error = message
                self.finish_request(req, RequestStatus.FINISHED_ERROR)
                failed.append(req)
        return failed

    def expire_queued(self, now: float) -> list[Request]:
        """Fail the requests whose queue deadline passed before their first scheduling (deadlines.py)."""
        expired = self.deadlines.pop_expired(now)
        for req in expired:
            req.error = timeout_message(req, now, queue_limit(req, self.config.max_queue_time))
            self.finish_request(req, RequestStatus.FINISHED_ERROR)
        self.stats.num_queue_timeouts += len(expired)
        return expired

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.step += 1
        out = SchedulerOutput(self.step)
        self.running.sort(key=victim_key)
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledSeq] = {}
        try:
            if self.config.scheduling_policy == "static":
                self._admit_static_batch()
                if not self.running and self.swapped:
                    self._return_swapped_members(out, budget)
                self._schedule_running(out, budget, list(self.running), scheduled)
            else:
                decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
                budget = self._schedule_running(out, budget, decodes, scheduled)
                self._charge_decodes()   # before the rest of the budget is ranked by service
                budget = self._schedule_by_rank(out, budget, scheduled)
                if self.speculator is not None and budget > 0:
                    self._add_drafts(out, budget)
            if not self.running and self.swapped and not out.scheduled:
                self._unpin_swapped()
            self._charge_decodes()
        finally:
            self.kv.end_step()   # the plan is built: host blocks its swap-ins read may serve the next one
        if out.scheduled:   # (only such a plan reaches the executor's execute())
            out.forget_ids = list(self._forget)
        self._record(out)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, reqs: list[Request],
                          scheduled: dict[str, ScheduledSeq]) -> int:
        for req in reqs:
            if budget <= 0:
                break
            budget = self._schedule_chunk(req, out, budget, scheduled)
        return budget

    def _schedule_chunk(self, req: Request, out: SchedulerOutput, budget: int,
                        scheduled: dict[str, ScheduledSeq]) -> int:
        """Give a running request its next chunk (one token for a decode), if memory allows."""
        if req.status != RequestStatus.RUNNING or req.request_id in scheduled:   # preempted earlier
            return budget
        n = self._first_chunk(req, budget)
        ok, returned = self._grow(req, n, scheduled, out)
        budget += returned
        if ok:
            scheduled[req.request_id] = self._add(out, req, n)
            budget -= n
        return budget

    def _schedule_by_rank(self, out: SchedulerOutput, budget: int, scheduled: dict[str, ScheduledSeq]) -> int:
        """After the decodes, the rest of the budget goes by rank (priority, then the tenant's service,
        then arrival: ``_rank``) to running prefill chunks and to requests coming in from the queue
        (swapped ones back, waiting ones admitted): a better-ranked arrival gets its tokens before
        worse-ranked chunks. Ranks move within the step as tenants are given tokens. The queue is
        served in rank order only: once its head cannot come in, nobody behind it does this step."""
        prefills = _RankHeap(self._rank, [r for r in self.running if r.request_id not in scheduled])
        held_back: list[Request] = []
        admitting = True
        self._reserved = None
        while budget > 0:
            nxt = prefills.peek()
            head = self._queue_head(held_back) if admitting else None
            if head is not None and (nxt is None or self._rank(head) < self._rank(nxt)):
                n = self._bring_in(head, out, budget)
                if not n and head.preempted_step != self.step:
                    preempted, returned = self._preempt_for_priority(head, out, budget, scheduled)
                    budget += returned
                    n = self._bring_in(head, out, budget) if preempted else 0
                if n:
                    scheduled[head.request_id] = out.scheduled[-1]
                    budget -= n
                else:
                    admitting = False
                continue
            if nxt is None:
                break
            prefills.pop()
            budget = self._schedule_chunk(nxt, out, budget, scheduled)
        for req in held_back:
            self.waiting.push(req)
        return budget

    def _add_drafts(self, out: SchedulerOutput, budget: int) -> None:
        """Speculative decoding, once everything else of the step is planned: what it left -- token
        budget, and free KV blocks beyond what the running requests are predicted to need and the
        reservation buffer -- may go to drafts of its decodes, as extra tokens of their chunks; the
        speculator picks which and how many by cost (conveyor/spec/speculator.py). So a draft never
        delays a prompt, never preempts anyone, and takes no block that admission counts on."""
        decodes = []
        for seq in out.scheduled:
            req = self.requests[seq.request_id]
            if seq.sample and seq.num_tokens == 1 and self._is_decode(req, 1):
                decodes.append((req, seq))
        if not decodes:
            return
        drafts = self.speculator.drafts([r for r, _ in decodes], out.num_prefill_tokens, budget)
        if not drafts:
            return
        spare = self.kv.num_free_blocks - self._reserved_blocks() - self._buffer()
        for req, seq in decodes:
            proposed = drafts.get(req.request_id)
            if not proposed or budget <= 0:
                continue
            k = min(len(proposed), budget, self.kv.max_chunk(req.num_computed_tokens) - 1)
            while k > 0 and self.kv.blocks_needed(req, 1 + k) > spare:
                k -= 1
            if k <= 0:
                continue
            spare -= self.kv.blocks_needed(req, 1 + k)
            ok = self.kv.allocate(req, 1 + k)
            assert ok, "the drafts' blocks were counted free"
            budget -= k
            self.tenants.charge(req.tenant, 0, k)
            seq.token_ids.extend(proposed[:k])
            seq.num_drafts = k
            rid, table = req.request_id, self.kv.block_table(req.request_id)
            seq.new_block_ids.extend(table[self._sent_blocks[rid]:])   # the runner's view: blocks since _add
            self._sent_blocks[rid] = len(table)
            out.num_decode_tokens += k

    def _queue_head(self, held_back: list[Request]) -> Request | None:
        """The best-ranked queued request (waiting or swapped) that can come in now; followers
        waiting for their leader's prefill are set aside for this step, and so are the requests of
        tenants at their running cap (skipped in the queue). A request whose LoRA adapter would be one
        too many for the runner is set aside too, and with it every LoRA request behind it for the
        step (their adapters must drain for it to come in: it cannot starve); base-model requests
        still come in. At most max_num_seqs are set aside a step: then nobody comes in."""
        lora_blocked = False
        while True:
            req = self.waiting.peek(self.tenants.capped)
            if req is None:
                return None
            if not self._waits_for_leader(req) and (req.lora is None or not lora_blocked):
                if self._lora_fits(req):
                    return req
                lora_blocked = True
            if len(held_back) >= self.config.max_num_seqs:
                return None
            held_back.append(self.waiting.pop(self.tenants.capped))

    def _lora_fits(self, req: Request, held: dict[int, int] | set[int] | None = None) -> bool:
        """The runner can hold the request's adapter with those of the requests it holds (`held`:
        the adapters counted so far, default those the runner holds)."""
        held = self._held_loras if held is None else held
        return req.lora is None or not self.max_loras or req.lora.lora_int_id in held or len(held) < self.max_loras

    def _hold_lora(self, req: Request, delta: int) -> None:
        """The runner starts (+1) or stops (-1) holding a request: count its adapter."""
        if req.lora is None:
            return
        key = req.lora.lora_int_id
        n = self._held_loras.get(key, 0) + delta
        if n:
            self._held_loras[key] = n
        else:
            del self._held_loras[key]

    def _charge_decodes(self) -> None:
        """The planned decodes' tokens to their tenants, counted per tenant (one charge each, not one
        per decode: at 256 decodes a step, a charge per decode cost ~0.1 ms)."""
        if self._decoded:
            for tenant, n in Counter(self._decoded).items():
                self.tenants.charge(tenant, 0, n)
            self._decoded.clear()

    def _rank(self, req: Request) -> tuple[int, float, int]:
        """Who gets the step's tokens first, smaller first: priority, the tenant's service (VTC), arrival."""
        return req.priority, self.tenants.counter(req.tenant), req.arrival_seq

    def _bring_in(self, req: Request, out: SchedulerOutput, budget: int) -> int:
        """Admit the queue's head (or swap it back in) with its first chunk; returns the chunk's
        tokens, 0 if it does not fit (slots, or memory under the admission policy)."""
        if len(self.running) >= self.config.max_num_seqs or req.preempted_step == self.step:
            return 0   # (a request preempted in this step does not come back in the same step)
        swapped = req.status == RequestStatus.SWAPPED
        cached = NO_PREFIX if swapped else self.kv.find_cached_prefix(req)
        lifetime, need_now = self._entry_blocks(req, cached, budget)
        reserved = self._reserved_blocks()
        if (self.running and lifetime + reserved + self._buffer() > self.kv.num_free_blocks) \
                or need_now > self.kv.num_free_blocks:
            self.stats.admission_deferrals += 1
            return 0
        self.waiting.take(req, self.tenants.capped)   # (the order may have moved since the peek)
        if swapped:
            self._swap_in(req, out)
        else:
            req.num_computed_tokens = cached.num_blocks * self.kv.block_size
            if cached.prompt_logprobs is not None:   # entries the cached blocks kept (kv/prefix_cache.py)
                req.prompt_logprobs = cached.prompt_logprobs
            if req.metrics.first_scheduled_time is None:
                req.metrics.num_cached_tokens = req.num_computed_tokens
            self.kv.record_prefix_lookup(req, cached)
        n = self._first_chunk(req, budget)
        ok = self.kv.allocate(req, n, cached)
        assert ok, "the admission check counted the blocks of the first chunk"
        self._resume(req)
        self._add(out, req, n)
        self._reserved = reserved + self._future_blocks(req)
        return n

    def _first_chunk(self, req: Request, budget: int, computed: int | None = None) -> int:
        """Tokens of the request's next chunk (computed: where it starts, default its computed tokens)."""
        start = req.num_computed_tokens if computed is None else computed
        return min(req.num_tokens - start, budget, self.config.prefill_chunk_cap, self.kv.max_chunk(start))

    def _entry_blocks(self, req: Request, cached: CachedPrefix, budget: int) -> tuple[int, int]:
        """(free blocks it is predicted to take over its life, free blocks it takes now) for a
        queued request coming in: a waiting one with these prefix-cache hits, or a swapped one
        (its host blocks come back; the blocks it shares stayed on the device)."""
        predicted = self._lifetime_blocks(req)
        if req.status == RequestStatus.SWAPPED:
            held = self.kv.num_swapped_blocks(req.request_id) + self.kv.num_pinned(req.request_id)
            first = self.kv.blocks_for(req.num_computed_tokens + self._first_chunk(req, budget), req.num_computed_tokens)
            now = self.kv.num_swapped_blocks(req.request_id) + max(0, first - held)
            return max(now, predicted - self.kv.num_pinned(req.request_id)), now
        revived = self.kv.num_revived(cached)
        computed = cached.num_blocks * self.kv.block_size
        first = self.kv.blocks_for(computed + self._first_chunk(req, budget, computed), computed)
        now = max(0, first - cached.pages) + revived
        return max(now, predicted - cached.pages + revived), now

    def _reserved_blocks(self) -> int:
        """Blocks the running requests are still predicted to need (cached within a step until a
        preemption or admission changes the running set)."""
        if self._reserved is None:
            self._reserved = sum(self._future_blocks(r) for r in self.running)
        return self._reserved

    def _buffer(self) -> int:
        return int(self.admission.buffer_fraction * self.kv.num_blocks)

    def _grow(self, req: Request, n: int, scheduled: dict[str, ScheduledSeq],
              out: SchedulerOutput) -> tuple[bool, int]:
        """Allocate room for n more tokens, preempting running requests ranked below req if memory
        is short (a victim already scheduled in this step is taken out of the step again, so a
        high-priority prefill never gives way to a low-priority decode). Victims of req's own
        priority that resumed less than min_resident_steps ago are spared while others can make
        room. If even all lower-ranked requests could not make room, req gives way itself and
        nobody else is preempted for nothing.
        Returns (success, tokens of budget given back by un-scheduled victims)."""
        if self.kv.allocate(req, n):
            return True, 0
        short = self.kv.blocks_needed(req, n) - self.kv.num_free_blocks
        victims = self._victims_for(req, short)
        returned = 0
        for victim in victims:
            if victim.request_id in scheduled:
                returned += self._unschedule(out, scheduled.pop(victim.request_id))
            self._preempt(victim, out)
            if self.kv.allocate(req, n):
                return True, returned
        self._preempt(req, out)   # (the estimate can only be off when victims share blocks)
        return False, returned

    def _victims_for(self, req: Request, short: int) -> list[Request]:
        """The victims, in preemption order, that make `short` blocks of room for req: those past
        their residency first; the resident ones of req's priority too if needed; none if even
        all of them would not make room."""
        for resident in (self.config.min_resident_steps, 0):
            eligible = eligible_victims(self.running, req, self.step, resident, self.kv)
            ordered = order_victims(eligible, self.kv, self.config.preemption_mode, self.costs,
                                    self.config.victim_policy)
            if sum(self._blocks_freed_by(ordered)) >= short:
                if resident == 0 and self.config.min_resident_steps > 0:
                    self.stats.residency_overrides += 1
                return ordered
        return []

    def _blocks_freed_by(self, victims: list[Request], keep: set[int] | frozenset = frozenset()) -> list[int]:
        """Blocks each victim's preemption frees, in this order (see KVCacheManager.blocks_freed_by);
        blocks in `keep` are not counted (a head's prefix-cache hits: freed, it must take them back)."""
        mode, costs = self.config.preemption_mode, self.costs
        return self.kv.blocks_freed_by(victims, lambda v: victim_cost(mode, v, self.kv, costs).mode == "swap", keep)

    def _admit_static_batch(self) -> None:
        """Static batching: a fixed batch admitted together; nobody joins until all finish."""
        if self.running or self.swapped:
            return
        free, loras = self.kv.num_free_blocks, set(self._held_loras)   # (admitted now, sent later)
        while len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek(self.tenants.capped)
            if req is None or not self._lora_fits(req, loras):
                break
            need = self.kv.blocks_for(req.num_prompt_tokens + req.max_tokens)
            if self.running and need > free:
                break
            free -= need
            if req.lora is not None:
                loras.add(req.lora.lora_int_id)
            self.waiting.take(req, self.tenants.capped)
            self._resume(req)

    def _return_swapped_members(self, out: SchedulerOutput, budget: int) -> None:
        """Static batching: no member of the batch runs, but some were swapped out (a member short
        of memory took their room). They come back, in rank order as memory and slots allow,
        before a new batch may start (which waits for them: without this they never would)."""
        for req in sorted(self.swapped, key=victim_key):
            if len(self.running) >= self.config.max_num_seqs:
                break
            if req.preempted_step == self.step or self._entry_blocks(req, NO_PREFIX, budget)[1] > self.kv.num_free_blocks:
                continue
            self.waiting.remove(req)
            self._swap_in(req, out)
            self._resume(req)

    def _swap_in(self, req: Request, out: SchedulerOutput) -> None:
        """A swapped request's KV copied back into device blocks by this step's plan."""
        out.swap_in.extend(self.kv.swap_in(req))
        self.swapped.remove(req)
        self.stats.num_swaps_in += 1

    def _preempt_for_priority(self, head: Request, out: SchedulerOutput, budget: int,
                              scheduled: dict[str, ScheduledSeq]) -> tuple[bool, int]:
        """The queue's head (waiting or swapped), reached with `budget` tokens left in this step but
        short of a slot or memory, takes the place of running requests of worse priority.

        Victims are taken in preemption order (worst priority, then cheapest to bring back) until
        the head would pass the entry check, counting only the blocks preemption really frees
        (not blocks shared with survivors, nor the head's own prefix-cache hits, which it would
        have to take back). If even all of them would not make room, nobody is preempted (their
        work would be lost for nothing). A victim already scheduled in this step gives its tokens
        back. Returns (someone was preempted, tokens given back).
        """
        victims = [r for r in self.running if r.priority > head.priority]
        if not victims:
            return False, 0
        need_slot = len(self.running) >= self.config.max_num_seqs
        cached = NO_PREFIX if head.status == RequestStatus.SWAPPED else self.kv.find_cached_prefix(head)
        lifetime, need_now = self._entry_blocks(head, cached, budget)
        self._reserved = None
        free = self.kv.num_free_blocks
        short_check = lifetime + self._reserved_blocks() + self._buffer() - free
        short_now = need_now - free
        if not need_slot and short_check <= 0 and short_now <= 0:
            return False, 0
        chosen = []
        ordered = order_victims(victims, self.kv, self.config.preemption_mode, self.costs,
                                self.config.victim_policy)
        for v, freed in zip(ordered, self._blocks_freed_by(ordered, cached.block_ids())):
            if (chosen or not need_slot) and short_check <= 0 and short_now <= 0:
                break
            chosen.append(v)
            short_now -= freed
            short_check -= freed + self._future_blocks(v)
        if short_now > 0 or (short_check > 0 and len(chosen) < len(self.running)):
            return False, 0   # (with every running request gone the head would be admitted alone)
        returned = 0
        for v in chosen:
            if v.request_id in scheduled:
                returned += self._unschedule(out, scheduled.pop(v.request_id))
            self._preempt(v, out)
            self.stats.num_priority_preemptions += 1
        return True, returned

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.counts.stopped(victim)
        self.tenants.stopped(victim.tenant)
        self._reserved = None
        choice = victim_cost(self.config.preemption_mode, victim, self.kv, self.costs)
        if victim.resumed_step == self.step and victim.swapped_in_step == self.step:
            choice.mode = "recompute"   # its swap-in copy is still pending: its blocks hold nothing yet
        if not self.kv.num_held(victim.request_id):
            choice.mode = "recompute"   # no KV to copy (static batching admits before its first chunk's blocks)
        if choice.mode == "swap":   # the runner keeps its state; the table is sent anew on swap-in
            if victim.request_id in self._sent_blocks:
                self._sent_blocks[victim.request_id] = _RESEND_TABLE
            out.swap_out.extend(self.kv.swap_out(victim))
            out.swapped_out_ids.append(victim.request_id)
            victim.status = RequestStatus.SWAPPED
            self.swapped.append(victim)
            self.stats.num_swaps_out += 1
            self.stats.blocks_swapped_out += choice.copied
        else:   # the runner forgets it: it comes back in full
            self._unsend(victim)
            self.stats.tokens_recomputed += max(0, victim.num_computed_tokens
                                                - self.kv.num_shared_prefix_tokens(victim))
            self.kv.free(victim)
            _recompute_from_scratch(victim)
            victim.status = RequestStatus.WAITING
            self.stats.num_recomputes += 1
        self.waiting.push(victim)   # same (priority, arrival_seq): it keeps its place in the queue
        victim.metrics.num_preemptions += 1
        victim.metrics.preemption_times.append(self.clock())
        victim.preempted_step = self.step
        self.stats.num_preemptions += 1
        self.stats.preemption_cost += choice.cost

    def _unpin_swapped(self) -> None:
        """Nothing runs, yet the queue's head cannot come in: device blocks pinned by swapped
        requests (shared blocks whose other holders finished) are in its way. Those requests
        drop their KV and will be recomputed (rare; without it the engine would stall). One swapped
        out in this very step keeps its KV until the next step: the plan's swap-out copies and
        swapped_out_ids name it, and its host blocks must hold them (a running request that gave
        way to itself leaves nothing running, and is dropped here one step later if still stuck)."""
        for req in [r for r in self.swapped if self.kv.num_pinned(r.request_id) and r.preempted_step != self.step]:
            self.swapped.remove(req)
            self.kv.free(req)
            self._unsend(req)
            _recompute_from_scratch(req)
            req.status = RequestStatus.WAITING
            self.waiting.now_waiting(req)
            self.stats.num_swaps_dropped += 1

    # ---- helpers -------------------------------------------------------------------------
    def _future_blocks(self, req: Request) -> int:
        """Blocks the request is predicted to still need beyond what it holds."""
        return max(0, self._lifetime_blocks(req) - self.kv.num_held(req.request_id))

    def _lifetime_blocks(self, req: Request) -> int:
        """Blocks the request is predicted to hold at its peak: at its predicted length, and, while
        prompt chunks remain, with a chunk's blocks in each local layer group (they hold a chunk's
        blocks until its step is done; with one global group, just the length's blocks)."""
        left = req.num_tokens - req.num_computed_tokens
        chunk = min(left, self.config.prefill_chunk_cap, self.config.max_num_batched_tokens) if left > 1 else 1
        return self.kv.blocks_for(self.admission.predicted_total(req), chunk=chunk)

    def _waits_for_leader(self, req: Request) -> bool:
        leader = req.prefill_leader
        if leader is None or leader.is_finished or not self.kv.enable_prefix_caching:
            return False   # without the prefix cache there is nothing to share: no reason to wait
        return leader.num_computed_tokens < leader.num_prompt_tokens

    def _resume(self, req: Request) -> None:
        if req.status == RequestStatus.SWAPPED:
            req.swapped_in_step = self.step
        req.status = RequestStatus.RUNNING
        req.resumed_step = self.step
        self.running.append(req)
        self.counts.started(req)
        self.tenants.started(req.tenant)
        self._reserved = None
        if req.metrics.first_scheduled_time is None:
            req.metrics.first_scheduled_time = self.clock()

    @staticmethod
    def _is_decode(req: Request, n: int) -> bool:
        """(n: the chunk's known tokens, its drafts not counted)"""
        # A decode computes the KV of the latest sampled token; everything else (prompt chunks,
        # recomputation after preemption) counts as prefill.
        return (n == 1 and req.num_output_tokens > 0 and req.num_computed_tokens == req.num_tokens - 1
                and req.num_computed_tokens >= req.num_prompt_tokens)

    def _add(self, out: SchedulerOutput, req: Request, n: int) -> ScheduledSeq:
        c = req.num_computed_tokens
        pooling = req.params.pooling
        seq = ScheduledSeq(req.request_id, req.all_token_ids[c:c + n], c, [],
                           sample=c + n == req.num_tokens and pooling is None)
        self._send_state(req, seq)
        seq.pooling, seq.pool_end = pooling_of_chunk(req, c, n)
        targets = prompt_targets(req, c, n)
        if targets is not None:
            seq.prompt_targets_row, seq.prompt_targets = targets
            seq.prompt_logprobs = req.params.prompt_logprobs
        out.scheduled.append(seq)
        if self._is_decode(req, n):
            out.num_decode_tokens += n
            self._decoded.append(req.tenant)   # charged together (_charge_decodes)
        else:
            out.num_prefill_tokens += n
            self.tenants.charge(req.tenant, n, 0)
        return seq

    def _send_state(self, req: Request, seq: ScheduledSeq) -> None:
        """What the runner lacks of the request: all of it if it does not hold it, else the block
        ids allocated since it last got some (O(new blocks), whatever the context length)."""
        rid = req.request_id
        table = self.kv.block_table(rid)
        sent = self._sent_blocks.get(rid)
        if sent is None:
            seq.new_block_ids, seq.new = list(table), self._new_request_data(req)
            self._hold_lora(req, 1)
        elif sent == _RESEND_TABLE:   # swapped back in: new device blocks, the rest the runner kept
            seq.new_block_ids, seq.replace_table = list(table), True
        else:
            seq.new_block_ids = table[sent:]
        self._sent_blocks[rid] = len(table)

    @staticmethod
    def _new_request_data(req: Request) -> NewRequestData:
        p = req.params
        new = NewRequestData(p, req.seed, req.num_output_tokens, lora=req.lora)
        if p.needs_penalties or p.bad_words_token_ids or p.logits_processors:   # they read the history
            new.output_token_ids = req.output_token_ids   # (a copy: the property slices)
            if p.repetition_penalty != 1.0:
                new.prompt_token_ids = req.prompt_token_ids
        return new

    def _unsend(self, req: Request) -> None:
        """The request leaves the runner (finished, or preempted by recompute): tell it to forget it."""
        if self._sent_blocks.pop(req.request_id, None) is not None:
            self._forget.append(req.request_id)
            self._hold_lora(req, -1)

    def _unschedule(self, out: SchedulerOutput, seq: ScheduledSeq) -> int:
        out.scheduled.remove(seq)
        req = self.requests[seq.request_id]
        if seq.new is not None:   # the runner never gets this full data: the request is still new to it
            self._sent_blocks.pop(seq.request_id, None)
            self._hold_lora(req, -1)
        if self._is_decode(req, seq.num_tokens - seq.num_drafts):
            out.num_decode_tokens -= seq.num_tokens
            self.tenants.charge(req.tenant, 0, -seq.num_tokens)
        else:
            out.num_prefill_tokens -= seq.num_tokens
            self.tenants.charge(req.tenant, -seq.num_tokens, 0)
        self.waiting.lowered(req.tenant)   # given back: its queued lines rank better again
        return seq.num_tokens

    def _record(self, out: SchedulerOutput) -> None:
        s = self.stats
        s.steps = self.step
        s.num_running, s.num_waiting, s.num_swapped = len(self.running), len(self.waiting), len(self.swapped)
        s.step_prefill_tokens, s.step_decode_tokens = out.num_prefill_tokens, out.num_decode_tokens
        s.prompt_tokens_total += out.num_prefill_tokens

    # ---- after the forward pass ------------------------------------------------------------
    def update(self, out: SchedulerOutput, model_out: ModelOutput | None) -> list[tuple[Request, int]]:
        """Advance computed tokens, append sampled ones, finish what is done (scheduler/stopping.py).

        Returns the requests that got new tokens this step (finished ones included), each with how
        many (more than one where speculative tokens were accepted).
        """
        now = self.clock()
        touched = []
        del self._forget[:len(out.forget_ids)]   # delivered (later ones were appended after them)
        for s in out.scheduled:
            req = self.requests.get(s.request_id)
            if req is None:   # finished (aborted, stopped) while the step ran
                continue
            if s.num_drafts:
                self._update_speculated(req, s, model_out, now, touched)
                continue
            req.num_computed_tokens += s.num_tokens
            self.kv.publish_full_blocks(req)
            self.kv.slide(req)   # local layer groups give back blocks that left their window
            token = model_out.sampled[s.request_id] if s.sample else None
            if token is not None:
                if req.metrics.first_token_time is None:   # vLLM counts a prompt whole, once, here
                    self.stats.prompt_tokens_started += req.num_prompt_tokens
                    self.stats.prompt_tokens_cached += req.metrics.num_cached_tokens
                req.append_token(token, now)
                self.stats.generation_tokens_total += 1
                touched.append((req, 1))
            verdict = finish_verdict(req, token)
            if verdict is not None:
                self.finish_request(req, *verdict)
        return touched

    def _update_speculated(self, req: Request, s: ScheduledSeq, model_out: ModelOutput, now: float,
                           touched: list[tuple[Request, int]]) -> None:
        """A decode that verified drafts: its accepted drafts, then the sampled token, join the output
        one by one as if each had been a step of its own (the first that finishes it is the last);
        only the accepted tokens' KV counts as computed, and blocks allocated past it go back."""
        k = s.num_drafts
        accepted = model_out.num_accepted(s.request_id)
        assert 0 <= accepted <= k, (s.request_id, accepted, k)
        if self.speculator is not None:
            self.speculator.observe(s.request_id, k, accepted)
        emitted, verdict = 0, None
        for token in model_out.step_tokens(s):
            req.append_token(token, now, timed=not emitted)
            emitted += 1
            verdict = finish_verdict(req, token)
            if verdict is not None:
                break
        self.stats.generation_tokens_total += emitted
        self.stats.spec_rejected_tokens += k - accepted
        req.num_computed_tokens = min(s.num_computed_tokens + s.num_tokens - k + accepted, req.num_tokens - 1)
        if self.kv.trim(req, req.num_computed_tokens + 1) and req.request_id in self._sent_blocks:
            self._sent_blocks[req.request_id] = _RESEND_TABLE   # the runner's copy has the blocks given back
        self.kv.publish_full_blocks(req)
        self.kv.slide(req)
        touched.append((req, emitted))
        if verdict is not None:
            self.finish_request(req, *verdict)


_RESEND_TABLE = -1   # _sent_blocks: the runner holds the request but its table must be sent whole


class _RankHeap:
    """Requests by a rank that grows while they wait in it (tenants being served): an entry whose
    rank changed since it was pushed is pushed again when it reaches the top. (A tenant given tokens
    back by a victim taken out of the step ranks lower again; its entries below the top are then
    found a little late within that step, never lost.)"""

    def __init__(self, rank: Callable[[Request], tuple], requests: list[Request]):
        self._rank = rank
        self._heap = [(rank(r), i, r) for i, r in enumerate(requests)]
        heapq.heapify(self._heap)

    def peek(self) -> Request | None:
        while self._heap:
            key, i, req = self._heap[0]
            if req.status != RequestStatus.RUNNING:   # preempted earlier in the step
                heapq.heappop(self._heap)
                continue
            now = self._rank(req)
            if now == key:
                return req
            heapq.heapreplace(self._heap, (now, i, req))
        return None

    def pop(self) -> None:
        heapq.heappop(self._heap)


def _recompute_from_scratch(req: Request) -> None:
    """Preempted by recompute: its KV is gone, so are the per-chunk results it would compute again
    (a partial list of prompt logprobs; the runner forgets a pooled sum); sampled tokens stay."""
    req.num_computed_tokens = 0
    reset_prompt_logprobs(req)
