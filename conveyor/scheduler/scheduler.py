"""Iteration-level scheduler: one token budget per step, recomposed after every forward pass.

Each step: (0) a waiting request of higher priority may preempt running lower-priority work;
(1) running decodes, (2) further chunks of running prefills, (3) swapped requests coming
back, (4) admissions from the queue under the admission policy. Every request just moves
its ``num_computed_tokens`` toward its length; there is no separate prefill phase.
No torch here: the simulator drives this very class with a cost-model executor.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from conveyor.kv.manager import KVCacheManager
from conveyor.request import Request, RequestStatus
from conveyor.scheduler.admission import AdmissionPolicy, make_admission_policy
from conveyor.scheduler.config import SchedulerConfig
from conveyor.scheduler.output import ModelOutput, SamplingRow, ScheduledSeq, SchedulerOutput
from conveyor.scheduler.preemption import choose_mode, choose_victim, victim_key
from conveyor.scheduler.queue import WaitQueue


@dataclass(slots=True)
class SchedulerStats:
    steps: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    step_prefill_tokens: int = 0
    step_decode_tokens: int = 0
    prompt_tokens_total: int = 0          # prefill tokens computed (recomputation included)
    generation_tokens_total: int = 0
    num_preemptions: int = 0
    num_swaps_out: int = 0
    num_swaps_in: int = 0
    num_recomputes: int = 0
    num_priority_preemptions: int = 0
    admission_deferrals: int = 0          # steps in which the policy held the queue head back
    num_finished: int = 0
    num_aborted: int = 0
    num_errors: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, admission: AdmissionPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.kv = kv
        self.clock = clock   # timestamps: monotonic time in the engine, simulated time in the simulator
        self.admission = admission or make_admission_policy(
            config.admission_policy, config.admission_quantile, config.reservation_buffer)
        self.waiting = WaitQueue()
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._arrivals = 0
        self.step = 0

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
        capacity = self.kv.num_blocks * self.kv.block_size
        request.max_model_len = min(request.max_model_len or capacity, capacity)
        if request.arrival_time is None:
            request.arrival_time = request.metrics.arrival_time = self.clock()
        request.arrival_seq = self._arrivals
        self._arrivals += 1
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def finish_request(self, request: Request, status: RequestStatus, reason: int | str | None = None) -> None:
        """Leave the engine now (stop, length, abort, error); blocks are free for the next step."""
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        elif request.status == RequestStatus.WAITING:
            self.waiting.discard(request)
        self.kv.free(request)
        self.kv.forget(request)
        request.finish(status, self.clock(), reason)
        self.requests.pop(request.request_id, None)
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
        static = self.config.scheduling_policy == "static"
        if static:
            self._admit_static_batch()
        else:
            self._preempt_for_priority(out)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not static:
            if not out.swap_out:
                budget = self._swap_in(out, budget)
            self._admit(out, budget)
        self._record(out)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        scheduled: dict[str, ScheduledSeq] = {}
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for req in decodes + prefills:
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:   # preempted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget, self.config.prefill_chunk_cap)
            ok, returned = self._grow(req, n, scheduled, out)
            budget += returned
            if ok:
                scheduled[req.request_id] = self._add(out, req, n)
                budget -= n
        return budget

    def _grow(self, req: Request, n: int, scheduled: dict[str, ScheduledSeq],
              out: SchedulerOutput) -> tuple[bool, int]:
        """Allocate room for n more tokens, preempting lower-ranked requests (or req itself)
        if memory is short. A victim already scheduled in this step is taken out of the step
        again, so a high-priority prefill never gives way to a low-priority decode.
        Returns (success, tokens of budget given back by un-scheduled victims)."""
        returned = 0
        while not self.kv.allocate(req, n):
            victim = choose_victim(self.running, req, self.step, self.config.min_resident_steps)
            if victim.request_id in scheduled:
                returned += self._unschedule(out, scheduled.pop(victim.request_id))
            self._preempt(victim, out)
            if victim is req:
                return False, returned
        return True, returned

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        head = self.waiting.peek()
        if head is not None and self._waits_for_leader(head):
            head = None   # held back this step anyway (see _admit)
        for req in sorted(self.swapped, key=victim_key):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if head is not None and victim_key(head) < victim_key(req):
                break   # a better-ranked waiting request gets the room first
            held = self.kv.num_swapped_blocks(req.request_id)
            n = min(req.num_tokens - req.num_computed_tokens, budget, self.config.prefill_chunk_cap)
            extra = self.kv.blocks_for(req.num_computed_tokens + n) - held
            if held + max(0, extra) > self.kv.num_free_blocks:
                break
            out.swap_in.extend(self.kv.swap_in(req))
            self.swapped.remove(req)
            self._resume(req)
            ok = self.kv.allocate(req, n)
            assert ok
            self._add(out, req, n)
            budget -= n
            self.stats.num_swaps_in += 1
        return budget

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        reserved = sum(self._future_blocks(r) for r in self.running)
        buffer = int(self.admission.buffer_fraction * self.kv.num_blocks)
        held_back: list[Request] = []
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            if req is None:
                break
            if self._waits_for_leader(req):
                held_back.append(self.waiting.pop())
                continue
            cached = self.kv.find_cached_prefix(req)
            lifetime = self._lifetime_blocks(req, cached)
            if self.running and lifetime + reserved + buffer > self.kv.num_free_blocks:
                self.stats.admission_deferrals += 1
                break
            req.num_computed_tokens = len(cached) * self.kv.block_size
            n = min(req.num_tokens - req.num_computed_tokens, budget, self.config.prefill_chunk_cap)
            if not self.kv.allocate(req, n, cached):
                req.num_computed_tokens = 0
                self.stats.admission_deferrals += 1
                break
            self.kv.record_prefix_lookup(req, len(cached))
            self.waiting.pop()
            self._resume(req)
            self._add(out, req, n)
            budget -= n
            reserved += self._future_blocks(req)
        for req in held_back:
            self.waiting.push(req)

    def _admit_static_batch(self) -> None:
        """Static batching: a fixed batch admitted together; nobody joins until all finish."""
        if self.running or self.swapped:
            return
        free = self.kv.num_free_blocks
        while len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            if req is None:
                break
            need = self.kv.blocks_for(req.num_prompt_tokens + req.max_tokens)
            if self.running and need > free:
                break
            free -= need
            self.waiting.pop()
            self._resume(req)

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """A waiting request of better priority takes the place of worse-ranked running ones.

        Victims (worse priority, past their residency) are taken worst-first until the head
        would pass the admission check; if even all of them would not make room, nobody is
        preempted (their work would be lost for nothing).
        """
        head = self.waiting.peek()
        if head is None or self._waits_for_leader(head):
            return   # a head held back for its leader's prefill would not use the room
        victims = sorted((r for r in self.running if r.priority > head.priority
                          and self.step - r.resumed_step >= self.config.min_resident_steps),
                         key=victim_key, reverse=True)
        if not victims:
            return
        need_slot = len(self.running) >= self.config.max_num_seqs
        shortfall = self._admission_shortfall(head)
        if not need_slot and shortfall <= 0:
            return
        chosen, freed = [], 0
        for v in victims:
            if (chosen or not need_slot) and freed >= shortfall:
                break
            chosen.append(v)
            freed += self.kv.num_held(v.request_id) + self._future_blocks(v)
        if freed < shortfall:
            return
        for v in chosen:
            self._preempt(v, out)
            self.stats.num_priority_preemptions += 1

    def _admission_shortfall(self, req: Request) -> int:
        """Blocks missing for req to pass _admit's check now (<= 0: it would be admitted)."""
        lifetime = self._lifetime_blocks(req, self.kv.find_cached_prefix(req))
        reserved = sum(self._future_blocks(r) for r in self.running)
        buffer = int(self.admission.buffer_fraction * self.kv.num_blocks)
        return lifetime + reserved + buffer - self.kv.num_free_blocks

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        mode = choose_mode(self.config.preemption_mode, self.kv.num_held(victim.request_id),
                           victim.num_computed_tokens, self.kv.num_free_host_blocks,
                           self.config.swap_cost_per_block, self.config.recompute_cost_per_token)
        if mode == "swap":
            out.swap_out.extend(self.kv.swap_out(victim))
            out.swapped_out_ids.append(victim.request_id)
            victim.status = RequestStatus.SWAPPED
            self.swapped.append(victim)
            self.stats.num_swaps_out += 1
        else:
            self.kv.free(victim)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.WAITING
            self.waiting.push(victim)   # same (priority, arrival_seq): it keeps its place
            self.stats.num_recomputes += 1
        victim.metrics.num_preemptions += 1
        self.stats.num_preemptions += 1

    # ---- helpers -------------------------------------------------------------------------
    def _lifetime_blocks(self, req: Request, cached: list[int]) -> int:
        """New free blocks a waiting request is predicted to take over its life: its predicted
        length, less shared prefix-cache hits, plus hits that must be revived from the free queue."""
        return self.kv.blocks_for(self.admission.predicted_total(req)) - len(cached) + self.kv.num_revived(cached)

    def _future_blocks(self, req: Request) -> int:
        """Blocks the request is predicted to still need beyond what it holds."""
        return max(0, self.kv.blocks_for(self.admission.predicted_total(req)) - self.kv.num_held(req.request_id))

    def _waits_for_leader(self, req: Request) -> bool:
        leader = req.prefill_leader
        if leader is None or leader.is_finished or not self.kv.enable_prefix_caching:
            return False   # without the prefix cache there is nothing to share: no reason to wait
        return leader.num_computed_tokens < leader.num_prompt_tokens

    def _resume(self, req: Request) -> None:
        req.status = RequestStatus.RUNNING
        req.resumed_step = self.step
        self.running.append(req)
        if req.metrics.first_scheduled_time is None:
            req.metrics.first_scheduled_time = self.clock()

    @staticmethod
    def _is_decode(req: Request, n: int) -> bool:
        # A decode computes the KV of the latest sampled token; everything else (prompt chunks,
        # recomputation after preemption) counts as prefill.
        return (n == 1 and req.num_output_tokens > 0 and req.num_computed_tokens == req.num_tokens - 1
                and req.num_computed_tokens >= req.num_prompt_tokens)

    def _add(self, out: SchedulerOutput, req: Request, n: int) -> ScheduledSeq:
        c = req.num_computed_tokens
        pooling = req.params.pooling
        sampling = self._sampling_row(req) if c + n == req.num_tokens and pooling is None else None
        seq = ScheduledSeq(req.request_id, req.all_token_ids[c:c + n], c, list(self.kv.block_table(req.request_id)),
                           sampling)
        if pooling == "mean" or (pooling == "last" and c + n == req.num_tokens):
            seq.pooling = pooling   # rows to pool: every chunk's (mean), the prompt's last (last)
        last = req.num_prompt_tokens - 1
        if req.prompt_logprobs is not None and len(req.prompt_logprobs) == c + 1 and c < last:
            seq.prompt_targets = req.prompt_token_ids[c + 1:min(c + n, last) + 1]
            seq.prompt_logprobs = req.params.prompt_logprobs
        out.scheduled.append(seq)
        if self._is_decode(req, n):
            out.num_decode_tokens += n
        else:
            out.num_prefill_tokens += n
        return seq

    @staticmethod
    def _sampling_row(req: Request) -> SamplingRow:
        p = req.params
        row = SamplingRow(p, req.seed, req.num_output_tokens)
        if p.needs_penalties or p.bad_words_token_ids or p.logits_processors:   # they read the history
            row.output_token_ids = req.output_token_ids
            if p.repetition_penalty != 1.0:
                row.prompt_token_ids = req.prompt_token_ids
        return row

    def _unschedule(self, out: SchedulerOutput, seq: ScheduledSeq) -> int:
        out.scheduled.remove(seq)
        if self._is_decode(self.requests[seq.request_id], seq.num_tokens):
            out.num_decode_tokens -= seq.num_tokens
        else:
            out.num_prefill_tokens -= seq.num_tokens
        return seq.num_tokens

    def _record(self, out: SchedulerOutput) -> None:
        s = self.stats
        s.steps = self.step
        s.num_running, s.num_waiting, s.num_swapped = len(self.running), len(self.waiting), len(self.swapped)
        s.step_prefill_tokens, s.step_decode_tokens = out.num_prefill_tokens, out.num_decode_tokens
        s.prompt_tokens_total += out.num_prefill_tokens

    # ---- after the forward pass ------------------------------------------------------------
    def update(self, out: SchedulerOutput, model_out: ModelOutput | None) -> list[Request]:
        """Advance computed tokens, append sampled ones, finish on eos/stop ids/length.

        Returns the requests that got a new token this step (finished ones included).
        """
        now = self.clock()
        touched = []
        i = 0
        for s in out.scheduled:
            if s.sampling is not None:
                token = model_out.token_ids[i]
                i += 1
            req = self.requests.get(s.request_id)
            if req is None:   # finished (aborted, stopped) while the step ran
                continue
            req.num_computed_tokens += s.num_tokens
            self.kv.publish_full_blocks(req)
            if req.params.pooling is not None and req.num_computed_tokens >= req.num_prompt_tokens:
                self.finish_request(req, RequestStatus.FINISHED_STOPPED)   # embedded: nothing to generate
            if s.sampling is None:
                continue
            req.append_token(token, now)
            self.stats.generation_tokens_total += 1
            touched.append(req)
            self._check_stop(req, token)
        return touched

    def _check_stop(self, req: Request, token: int) -> None:
        p = req.params
        n_out = req.num_output_tokens
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in p.eos_token_ids:
                self.finish_request(req, RequestStatus.FINISHED_STOPPED)
                return
            if token in p.stop_token_ids:
                self.finish_request(req, RequestStatus.FINISHED_STOPPED, token)
                return
        if n_out >= req.max_tokens:
            self.finish_request(req, RequestStatus.FINISHED_LENGTH)

    def stats_dict(self) -> dict:
        d = asdict(self.stats)
        d.update(num_running=len(self.running), num_waiting=len(self.waiting), num_swapped=len(self.swapped))
        pool = self.kv.prefix_cache_stats
        d.update(kv_usage=self.kv.usage, num_kv_blocks=self.kv.num_blocks,
                 num_free_kv_blocks=self.kv.num_free_blocks,
                 prefix_cache_queries=pool.prefix_queries, prefix_cache_hits=pool.prefix_hits,
                 prefix_cache_hit_rate=pool.prefix_hits / pool.prefix_queries if pool.prefix_queries else 0.0,
                 prefix_cache_evictions=pool.evictions)
        return d
