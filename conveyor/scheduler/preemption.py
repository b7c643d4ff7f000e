"""Preemption policy: which running request gives way, and how (swap or recompute)."""

from __future__ import annotations

from conveyor.request import Request


def victim_key(request: Request) -> tuple[int, int]:
    """Larger = first to go: lowest priority (highest number), then latest arrival."""
    return (request.priority, request.arrival_seq)


def choose_victim(candidates: list[Request], needy: Request, step: int, min_resident_steps: int) -> Request:
    """Who gives way so that ``needy`` can grow: the worst-ranked candidate ranked below it
    that has run at least min_resident_steps since resuming, else ``needy`` itself.

    The residency rule stops thrashing: a request just swapped in or re-admitted is not
    thrown out again before it makes progress. A request never evicts a better-ranked one.
    """
    key = victim_key(needy)
    eligible = [r for r in candidates if r is not needy and victim_key(r) > key
                and step - r.resumed_step >= min_resident_steps]
    return max(eligible, key=victim_key) if eligible else needy


def choose_mode(mode: str, num_blocks: int, num_tokens: int, host_free: int,
                swap_cost_per_block: float, recompute_cost_per_token: float) -> str:
    """'swap' or 'recompute' for one victim holding num_blocks blocks for num_tokens tokens."""
    if mode == "recompute" or num_blocks > host_free:
        return "recompute"   # swap falls back to recompute when the host pool is full
    if mode == "swap":
        return "swap"
    swap_cost = 2 * num_blocks * swap_cost_per_block       # out now, back in later
    recompute_cost = num_tokens * recompute_cost_per_token
    return "swap" if swap_cost < recompute_cost else "recompute"
