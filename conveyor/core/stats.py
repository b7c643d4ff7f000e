"""Typed engine statistics: one frozen snapshot of the scheduler's, KV cache's and core's counters.

Decisions (the async loop's stall check and back-pressure, data-parallel routing, idle checks in
tests) read its fields; ``as_dict()`` exists only for output (Prometheus, JSON, benchmark files),
so a renamed counter breaks at the reader, not silently in a string key. It crosses the
process-engine pipe (core/wire.py), so every field has a declared type. No torch here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, fields
from itertools import zip_longest
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from conveyor.scheduler.scheduler import Scheduler


@dataclass(slots=True)
class CoreStats:
    """The core's own counters (mutable; EngineStats copies them)."""

    step_failures: int = 0             # steps whose executor raised
    consecutive_step_failures: int = 0
    last_step_time: float = 0.0        # seconds in the latest step()
    kv_invariant_checks: int = 0       # KV cache checks on the transition to idle
    kv_invariant_full_checks: int = 0  # of which block by block (see EngineCore.idle_check_share)
    kv_invariant_violations: int = 0   # of which found the cache not whole (a leak or a corrupt block)


@dataclass(slots=True, frozen=True)
class EngineStats:
    """The engine's state and cumulative counters as of one moment (end of a step, usually)."""

    # ---- the scheduler (scheduler.SchedulerStats, queue lengths live) ----
    steps: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    step_prefill_tokens: int = 0          # of the latest step
    step_decode_tokens: int = 0           # of the latest step
    prompt_tokens_total: int = 0          # prefill tokens computed (recomputation included)
    prompt_tokens_started: int = 0        # whole prompts of sequences that produced a first token (vLLM's)
    prompt_tokens_cached: int = 0         # of those, read from the prefix cache at first admission
    generation_tokens_total: int = 0
    num_preemptions: int = 0
    num_swaps_out: int = 0
    num_swaps_in: int = 0
    num_recomputes: int = 0
    num_priority_preemptions: int = 0
    blocks_swapped_out: int = 0
    tokens_recomputed: int = 0
    preemption_cost: float = 0.0
    num_swaps_dropped: int = 0
    residency_overrides: int = 0
    admission_deferrals: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_errors: int = 0
    num_queue_timeouts: int = 0
    # requests (an n > 1 request's sequences count once): in the running batch (any of its sequences), or
    # queued (none running, one waiting or swapped) -- vLLM's request counts (server/metrics.py)
    num_running_requests: int = 0
    num_waiting_requests: int = 0
    # ---- the KV cache ----
    kv_usage: float = 0.0                 # fraction of device blocks in use
    block_size: int = 0                   # tokens per KV block
    num_host_kv_blocks: int = 0           # host (swap) blocks
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0
    prefix_cache_queries: int = 0         # prompt blocks looked up
    prefix_cache_hits: int = 0
    prefix_cache_evictions: int = 0
    prefix_cache_mismatches: int = 0
    # KV layer groups (conveyor/kv/layout.py; one unless the model has sliding-window layers): each
    # group's window (0: global) and the prompt blocks each could have supplied alone (of
    # prefix_cache_queries); a hit needs every group, so prefix_cache_hits <= each of them.
    kv_group_windows: tuple[int, ...] = ()
    prefix_cache_group_hits: tuple[int, ...] = ()
    # ---- the core ----
    step_failures: int = 0
    consecutive_step_failures: int = 0
    last_step_time: float = 0.0           # seconds of the latest step (Engine: output processing included)
    engine_dead: bool = False
    kv_invariant_checks: int = 0
    kv_invariant_full_checks: int = 0
    kv_invariant_violations: int = 0
    # ---- set above the core ----
    weight_bytes: int = 0                 # model weights held in memory (all their copies)
    kv_cache_bytes: int = 0               # the device KV cache
    step_time_total: float = 0.0          # seconds inside Engine.step(), all steps (the async loop's)
    num_unfinished_requests: int = 0      # requests a client holds streams for (the client's)
    # ---- speculative decoding (conveyor/spec/; all 0 and () while it is off) ----
    spec_rejected_tokens: int = 0         # draft tokens computed and refused (the scheduler's)
    spec_num_drafts: int = 0              # verifications of a request's drafts (vLLM's num_drafts)
    spec_num_draft_tokens: int = 0        # draft tokens verified
    spec_num_accepted_tokens: int = 0     # of those, accepted
    # accepted drafts by position (index j: position j, 0-based; one entry per num_speculative_tokens,
    # so non-empty exactly when speculation is on): non-increasing, summing to spec_num_accepted_tokens
    spec_accepted_per_pos: tuple[int, ...] = ()
    # ---- LoRA adapters (vllm:lora_requests_info) ----
    max_lora: int = 0                     # adapters resident at once (0: LoRA off)
    lora_running: tuple[str, ...] = ()    # adapters with a sequence running
    lora_waiting: tuple[str, ...] = ()    # adapters with a sequence queued

    @classmethod
    def of(cls, scheduler: Scheduler, core: CoreStats, dead: bool) -> EngineStats:
        """A snapshot of a scheduler (its counters, queues and KV cache) and a core's counters."""
        s, kv = scheduler.stats, scheduler.kv
        pool = kv.prefix_cache_stats
        counters: dict[str, Any] = {f.name: getattr(s, f.name) for f in fields(s)}
        counters.update({f.name: getattr(core, f.name) for f in fields(core)})
        counters.update(num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
                        num_swapped=len(scheduler.swapped))
        requests = scheduler.counts   # kept as sequences come and go: O(1) here
        return cls(**counters, num_running_requests=requests.running,
                   num_waiting_requests=requests.live - requests.running,
                   kv_usage=kv.usage, block_size=kv.block_size, num_host_kv_blocks=kv.num_host_blocks,
                   num_kv_blocks=kv.num_blocks,
                   num_free_kv_blocks=kv.num_free_blocks, prefix_cache_queries=pool.prefix_queries,
                   prefix_cache_hits=pool.prefix_hits, prefix_cache_evictions=pool.evictions,
                   prefix_cache_mismatches=pool.mismatches, kv_group_windows=kv.windows,
                   prefix_cache_group_hits=tuple(kv.group_hits), engine_dead=dead,
                   max_lora=scheduler.max_loras, lora_running=tuple(sorted(requests.lora_running)),
                   lora_waiting=tuple(requests.lora_waiting), **_spec_counters(scheduler.speculator))

    @property
    def step_tokens(self) -> int:
        """Tokens the latest step computed (0: it did nothing)."""
        return self.step_prefill_tokens + self.step_decode_tokens

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def replace(self, **changes: Any) -> EngineStats:
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        """For output only (metrics, JSON, benchmark files): every field, plus the hit rate."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["prefix_cache_hit_rate"] = self.prefix_cache_hit_rate
        return d

    @classmethod
    def combine(cls, parts: Sequence[EngineStats]) -> EngineStats:
        """Several engines (data-parallel or simulated replicas) as one: counters summed, KV usage
        averaged, the latest step time and failure streak the worst, dead only if all are."""
        if not parts:
            return cls()
        summed = {f.name: sum(getattr(p, f.name) for p in parts) for f in fields(cls) if f.name not in _NOT_SUMMED}
        return cls(**summed, kv_usage=sum(p.kv_usage for p in parts) / len(parts),
                   block_size=max(p.block_size for p in parts),
                   last_step_time=max(p.last_step_time for p in parts),
                   consecutive_step_failures=max(p.consecutive_step_failures for p in parts),
                   engine_dead=all(p.engine_dead for p in parts), kv_group_windows=parts[0].kv_group_windows,
                   prefix_cache_group_hits=tuple(map(sum, zip(*(p.prefix_cache_group_hits for p in parts)))),
                   # a replica that has not reported yet has () here: the others' positions still count
                   spec_accepted_per_pos=tuple(map(sum, zip_longest(*(p.spec_accepted_per_pos for p in parts),
                                                                    fillvalue=0))),
                   max_lora=max(p.max_lora for p in parts),
                   lora_running=tuple(sorted({a for p in parts for a in p.lora_running})),
                   lora_waiting=tuple(sorted({a for p in parts for a in p.lora_waiting})))


_NOT_SUMMED = frozenset({"kv_usage", "last_step_time", "consecutive_step_failures", "engine_dead", "block_size",
                         "kv_group_windows", "prefix_cache_group_hits", "spec_accepted_per_pos", "max_lora",
                         "lora_running", "lora_waiting"})
_NO_SPEC: dict[str, Any] = {}


def _spec_counters(speculator) -> dict[str, Any]:
    """The speculator's counters (conveyor/spec/speculator.py SpecStats) as EngineStats fields; none
    (the defaults) while speculation is off."""
    if speculator is None:
        return _NO_SPEC
    st = speculator.stats
    return {"spec_num_drafts": st.num_drafts, "spec_num_draft_tokens": st.num_draft_tokens,
            "spec_num_accepted_tokens": st.num_accepted_tokens, "spec_accepted_per_pos": tuple(st.accepted_per_pos)}
