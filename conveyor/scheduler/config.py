"""Scheduler knobs (vLLM names where vLLM has the same knob)."""

from __future__ import annotations

from dataclasses import dataclass

PREEMPTION_MODES = ("recompute", "swap", "auto")
ADMISSION_POLICIES = ("optimistic", "conservative", "predictive")
SCHEDULING_POLICIES = ("continuous", "static")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024       # the per-step token budget
    long_prefill_token_threshold: int = 0    # per-request prefill cap per step; 0 = budget // 4 (min 64)
    preemption_mode: str = "recompute"
    admission_policy: str = "predictive"
    scheduling_policy: str = "continuous"
    # predictive admission: admit with the q-quantile of the learned output-length distribution
    # and keep reservation_buffer (a fraction of all blocks) free for growth beyond predictions.
    admission_quantile: float = 0.9
    reservation_buffer: float = 0.05
    min_resident_steps: int = 4              # a resumed request is not re-preempted this soon
    # auto preemption mode: relative costs (seconds) of copying one block both ways vs recomputing one token
    swap_cost_per_block: float = 2e-4
    recompute_cost_per_token: float = 1e-3

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.admission_policy not in ADMISSION_POLICIES:
            raise ValueError(f"admission_policy must be one of {ADMISSION_POLICIES}, got {self.admission_policy!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if not 0.0 < self.admission_quantile <= 1.0:
            raise ValueError("admission_quantile must be in (0, 1]")
        if not 0.0 <= self.reservation_buffer < 1.0:
            raise ValueError("reservation_buffer must be in [0, 1)")

    @property
    def prefill_chunk_cap(self) -> int:
        if self.long_prefill_token_threshold > 0:
            return self.long_prefill_token_threshold
        return max(64, self.max_num_batched_tokens // 4)
