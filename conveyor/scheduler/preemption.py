"""Preemption policy: which running request gives way, and how (swap or recompute).

Both choices are made per victim from what each option would really cost for it:

- swap: its unshared blocks copied to host memory and back (shared blocks stay on the
  device), possible only while the host pool has room for them;
- recompute: its computed tokens run again, less the leading blocks that other requests
  hold (they stay in the prefix cache, so the recomputation starts after them).

The costs in seconds come from ``PreemptionCosts``: constants, or the step cost model that
``conveyor profile`` measured (user-set constants win over the profile).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from conveyor.kv.manager import KVCacheManager
from conveyor.request import Request

DEFAULT_SWAP_COST_PER_BLOCK = 2e-4
DEFAULT_RECOMPUTE_COST_PER_TOKEN = 1e-3


def victim_key(request: Request) -> tuple[int, int]:
    """A request's rank, larger = worse: lowest priority (highest number), then latest arrival."""
    return (request.priority, request.arrival_seq)


@dataclass(slots=True)
class PreemptionCosts:
    swap_block: float = DEFAULT_SWAP_COST_PER_BLOCK              # seconds to copy one block one way
    recompute_token: float = DEFAULT_RECOMPUTE_COST_PER_TOKEN    # seconds per recomputed token
    recompute_time: Callable[[int], float] | None = None        # measured: seconds to recompute n tokens

    @classmethod
    def of(cls, config) -> PreemptionCosts:
        """The constants a SchedulerConfig sets (None: the defaults)."""
        swap, recompute = config.swap_cost_per_block, config.recompute_cost_per_token
        return cls(DEFAULT_SWAP_COST_PER_BLOCK if swap is None else swap,
                   DEFAULT_RECOMPUTE_COST_PER_TOKEN if recompute is None else recompute)

    def swap(self, num_blocks: int) -> float:
        return 2 * num_blocks * self.swap_block   # out now, back in later

    def recompute(self, num_tokens: int) -> float:
        if num_tokens <= 0:
            return 0.0
        return self.recompute_time(num_tokens) if self.recompute_time else num_tokens * self.recompute_token


@dataclass(slots=True)
class VictimCost:
    mode: str          # "swap" or "recompute"
    cost: float        # estimated seconds to bring it back
    freed: int         # device blocks that preempting it frees
    copied: int        # blocks copied to host (swap)
    recomputed: int    # tokens to compute again (recompute)


def victim_cost(mode: str, victim: Request, kv: KVCacheManager, costs: PreemptionCosts) -> VictimCost:
    """How preempting this victim would go under the configured mode ('swap', 'recompute', 'auto')."""
    freed = kv.num_unshared(victim.request_id)
    recomputed = max(0, victim.num_computed_tokens - kv.num_shared_prefix_tokens(victim))
    recompute = VictimCost("recompute", costs.recompute(recomputed), freed, 0, recomputed)
    if mode == "recompute" or freed > kv.num_free_host_blocks:
        return recompute   # swap falls back to recompute when the host pool has no room
    swap = VictimCost("swap", costs.swap(freed), freed, freed, 0)
    if mode == "swap":
        return swap
    return swap if swap.cost < recompute.cost else recompute


def order_victims(candidates: list[Request], kv: KVCacheManager, mode: str,
                  costs: PreemptionCosts, policy: str = "cost") -> list[Request]:
    """Candidates in the order they give way: lowest priority first; within a priority the
    cheapest to bring back first (least work wasted), then the latest arrival. With policy
    "latest": the latest arrival first (vLLM's rule)."""
    if policy == "latest":
        return sorted(candidates, key=victim_key, reverse=True)
    cost = {id(r): victim_cost(mode, r, kv, costs).cost for r in candidates}
    return sorted(candidates, key=lambda r: (-r.priority, cost[id(r)], -r.arrival_seq))


def eligible_victims(running: list[Request], needy: Request, step: int, min_resident_steps: int,
                     kv: KVCacheManager) -> list[Request]:
    """Running requests that may give way so that ``needy`` can grow: ranked below it, and
    freeing at least one block. The residency rule (anti-thrash) protects a request that
    resumed less than min_resident_steps ago only from requests of its own priority: work of
    a better priority never waits for it."""
    key = victim_key(needy)
    return [r for r in running if r is not needy and victim_key(r) > key
            and (r.priority > needy.priority or step - r.resumed_step >= min_resident_steps)
            and kv.num_unshared(r.request_id) > 0]
