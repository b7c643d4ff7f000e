"""Scheduler knobs (vLLM names where vLLM has the same knob)."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.config_fields import check_choice, option

PREEMPTION_MODES = ("recompute", "swap", "auto")
ADMISSION_POLICIES = ("optimistic", "conservative", "predictive")
SCHEDULING_POLICIES = ("continuous", "static")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = option(128, "most sequences in one step's batch")
    max_num_batched_tokens: int = option(1024, "token budget of one step (decodes + prefill chunks)")
    long_prefill_token_threshold: int = option(
        0, "most prompt tokens one request computes in a step (0 = max(64, budget / 4))")
    preemption_mode: str = option("recompute", "how a preempted request gives back its KV: recompute it "
                                  "later, swap it to host memory, or auto (by estimated cost)",
                                  choices=PREEMPTION_MODES)
    admission_policy: str = option("predictive", "how much future KV a request must fit before it is admitted",
                                   choices=ADMISSION_POLICIES)
    scheduling_policy: str = option("continuous", "continuous batching, or the static batching baseline",
                                    choices=SCHEDULING_POLICIES)
    # predictive admission: admit with the q-quantile of the learned output-length distribution
    # and keep reservation_buffer (a fraction of all blocks) free for growth beyond predictions.
    admission_quantile: float = option(0.9, "predictive admission: quantile of the learned output-length "
                                            "distribution a request is admitted with")
    reservation_buffer: float = option(0.05, "predictive admission: fraction of KV blocks kept free for growth")
    min_resident_steps: int = option(4, "steps a resumed request runs before it can be preempted again")
    # auto preemption mode: relative costs (seconds) of copying one block both ways vs recomputing one token
    swap_cost_per_block: float = option(2e-4, "auto preemption: estimated seconds to copy one KV block one way")
    recompute_cost_per_token: float = option(1e-3, "auto preemption: estimated seconds to recompute one token")

    def __post_init__(self) -> None:
        check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        check_choice("admission_policy", self.admission_policy, ADMISSION_POLICIES)
        check_choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
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
