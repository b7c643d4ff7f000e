"""Scheduler knobs (vLLM names where vLLM has the same knob)."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.config_fields import check_choice, option

PREEMPTION_MODES = ("recompute", "swap", "auto")
ADMISSION_POLICIES = ("optimistic", "conservative", "predictive")
SCHEDULING_POLICIES = ("continuous", "static")
VICTIM_POLICIES = ("cost", "latest")
TENANT_FAIRNESS = ("vtc", "fcfs")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = option(128, "most sequences in one step's batch")
    max_num_batched_tokens: int = option(1024, "token budget of one step (decodes + prefill chunks)")
    long_prefill_token_threshold: int = option(
        0, "most prompt tokens one request computes in a step (0 = max(64, budget / 4))")
    preemption_mode: str = option("recompute", "how a preempted request gives back its KV: recompute it "
                                  "later, swap it to host memory, or auto (by estimated cost)",
                                  choices=PREEMPTION_MODES)
    victim_policy: str = option("cost", "which running request of the lowest priority gives way: the cheapest to "
                                        "bring back (cost), or the latest arrival (latest, vLLM's rule)",
                                choices=VICTIM_POLICIES)
    admission_policy: str = option("predictive", "how much future KV a request must fit before it is admitted",
                                   choices=ADMISSION_POLICIES)
    scheduling_policy: str = option("continuous", "continuous batching, or the static batching baseline",
                                    choices=SCHEDULING_POLICIES)
    # predictive admission: admit with the q-quantile of the learned output-length distribution
    # and keep reservation_buffer (a fraction of all blocks) free for growth beyond predictions.
    admission_quantile: float = option(0.9, "predictive admission: quantile of the learned output-length "
                                            "distribution a request is admitted with")
    reservation_buffer: float = option(0.05, "predictive admission: fraction of KV blocks kept free for growth")
    admission_half_life: float = option(
        256.0, "predictive admission: finished requests after which an observed output length weighs half "
               "(the learned distribution follows a shifting workload; 0 = never forget)")
    min_resident_steps: int = option(4, "steps a resumed request runs before a request of its own priority can "
                                        "preempt it again (better priorities never wait for it)")
    # auto preemption mode: relative costs (seconds) of copying one block both ways vs recomputing one token
    # (None: from the `conveyor profile` cost model when there is one, else 2e-4 and 1e-3; a value set
    # here wins over the profile)
    swap_cost_per_block: float | None = option(
        None, "auto preemption: seconds to copy one KV block one way (default: measured by `conveyor profile`, "
              "else 2e-4)")
    recompute_cost_per_token: float | None = option(
        None, "auto preemption: seconds to recompute one token (default: the profile's step-cost curve, "
              "else 1e-3)")
    max_queue_time: float | None = option(
        None, "seconds a request may wait for its first scheduling before it fails with a queue timeout "
              "instead of being served late (default: no limit); a request's own max_queue_time can only "
              "shorten it")

    tenant_fairness: str = option(
        "vtc", "among requests of equal priority, serve the tenant with the least service first (vtc: Virtual Token "
               "Counter) or strictly by arrival (fcfs); a tenant is the request's user, API key or tenant header",
        choices=TENANT_FAIRNESS)
    tenant_weights: str | None = option(
        None, "tenants' shares of service under vtc, as name=weight,... (default weight 1)")
    tenant_max_running: int = option(0, "most sequences of one tenant running at once (0: no cap); the rest of "
                                        "its requests wait while other tenants' come in")

    def __post_init__(self) -> None:
        check_choice("tenant_fairness", self.tenant_fairness, TENANT_FAIRNESS)
        if self.tenant_max_running < 0:
            raise ValueError(f"tenant_max_running must be >= 0, got {self.tenant_max_running}")
        self.tenant_weight_map   # a malformed one fails here
        check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        check_choice("admission_policy", self.admission_policy, ADMISSION_POLICIES)
        check_choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        check_choice("victim_policy", self.victim_policy, VICTIM_POLICIES)
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if not 0.0 < self.admission_quantile <= 1.0:
            raise ValueError("admission_quantile must be in (0, 1]")
        if not 0.0 <= self.reservation_buffer < 1.0:
            raise ValueError("reservation_buffer must be in [0, 1)")
        if self.admission_half_life < 0:
            raise ValueError("admission_half_life must be >= 0")
        for name in ("swap_cost_per_block", "recompute_cost_per_token"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"{name} must be >= 0")
        if self.max_queue_time is not None and not self.max_queue_time > 0:
            raise ValueError(f"max_queue_time must be > 0 seconds (or None: no limit), got {self.max_queue_time!r}")

    @property
    def tenant_weight_map(self) -> dict[str, float]:
        return parse_tenant_weights(self.tenant_weights)

    @property
    def prefill_chunk_cap(self) -> int:
        if self.long_prefill_token_threshold > 0:
            return self.long_prefill_token_threshold
        return max(64, self.max_num_batched_tokens // 4)


def parse_tenant_weights(text: str | None) -> dict[str, float]:
    """``"alice=2,bob=0.5"`` -> {"alice": 2.0, "bob": 0.5}; weights must be > 0."""
    weights: dict[str, float] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, value = item.rpartition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = float("nan")
        if not sep or not name.strip() or not weight > 0 or weight == float("inf"):
            raise ValueError(f"tenant_weights: expected name=weight with a weight > 0, got {item.strip()!r}")
        weights[name.strip()] = weight
    return weights
