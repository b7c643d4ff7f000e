"""Fair service between tenants: the Virtual Token Counter (Sheng et al., "Fairness in Serving Large
Language Models", OSDI 2024), applied inside the continuous batch.

Each tenant has a counter of the service it received: every token the scheduler gives it (a prompt
chunk's tokens, a decode token, verified drafts) adds its weight (``TokenWeights``: prefill and
decode tokens priced by the cost model), divided by the tenant's own weight. Among requests of equal
priority, the queue admits the head of the tenant with the least service (FCFS within a tenant), and
running prefill chunks get the step's leftover budget in the same order. A tenant that comes back
after being idle is lifted to the least counter of the tenants with work, so it cannot bank credit
while away, and a newcomer never starts far ahead or behind. With one tenant (or none named) every
counter ties and the order is exactly first come, first served.

VTC's bound follows: while two tenants both have work queued, their service differs by at most
about ``2 * max(weight_p * prompt + weight_d * max_tokens)`` of one request, whatever the other's
load (docs/scheduling.md derives it for this scheduler, chunked prefill included).
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass

from conveyor.request import Request, RequestStatus
from conveyor.scheduler.request_counts import enter, leave

_QUEUED = (RequestStatus.WAITING, RequestStatus.SWAPPED)
MAX_IDLE_TENANTS = 4096   # tenants without work whose counters the ledger keeps (TenantLedger.left)


@dataclass(frozen=True, slots=True)
class TokenWeights:
    """Service counted per prompt token and per decode token (VTC's w_p and w_q)."""

    prefill: float = 1.0
    decode: float = 2.0   # the paper's default ratio; the engine takes it from the cost model

    @classmethod
    def of(cls, cost) -> TokenWeights:
        """From a StepCostModel: a prompt token's marginal cost in a big chunk against a decode token's
        in a mid-size batch (its matmul share, sampling, per-sequence work and a 256-token context read)."""
        if cost is None or not hasattr(cost, "token_cost"):
            return cls()
        big = cost.knots[-1]
        prefill = (cost.token_cost(big) - cost.token_cost(max(1, big // 4))) / max(1, big - big // 4)
        decode = (cost.token_cost(32) - cost.token_cost(16)) / 16 + cost.sampled + cost.seq + \
            cost.context_slope(16) * 256
        if not (prefill > 0 and decode > 0):
            return cls()
        return cls(1.0, decode / prefill)


class TenantLedger:
    """Per-tenant counters, weights and live work (queued + running requests)."""

    def __init__(self, weights: dict[str, float] | None = None, token_weights: TokenWeights | None = None,
                 enabled: bool = True, max_running: int = 0):
        self.enabled = enabled
        self.max_running = max_running   # per tenant (0: no cap); tenants at it are `capped`
        self.capped: set[str] = set()
        self.weights = dict(weights or {})
        self.token_weights = token_weights or TokenWeights()
        self.service: dict[str, float] = {}   # virtual tokens (what the order compares)
        self.tokens: dict[str, int] = {}      # real tokens computed, for metrics and studies
        self.live: Counter[str] = Counter()      # requests of the tenant in the engine (queued or running)
        self.running: Counter[str] = Counter()   # ... of them running
        self.max_idle = MAX_IDLE_TENANTS

    def counter(self, tenant: str) -> float:
        return self.service.get(tenant, 0.0) if self.enabled else 0.0

    def arrived(self, tenant: str) -> None:
        """A request of `tenant` entered the engine: if it had none, lift its counter (VTC)."""
        if tenant not in self.live:
            active = [self.service.get(t, 0.0) for t in self.live]
            if active:
                self.service[tenant] = max(self.service.get(tenant, 0.0), min(active))
        enter(self.live, tenant)

    def left(self, tenant: str) -> None:
        if not leave(self.live, tenant):
            return
        # Forget a tenant whose counter its return would lift anyway (at or below the least of those with
        # work); with nobody left, everyone's. A tenant that leaves ahead keeps its counter (coming back
        # it starts there: no credit for leaving), up to max_idle such tenants: beyond, the lower half of
        # them by counter is forgotten (the ones nearest to where a return would lift them).
        active = [self.service.get(t, 0.0) for t in self.live]
        if not active:
            self.service.clear()
            self.tokens.clear()
        elif self.service.get(tenant, 0.0) <= min(active):
            self.forget(tenant)
        elif len(self.service) > len(self.live) + self.max_idle:
            idle = sorted((c, t) for t, c in self.service.items() if t not in self.live)
            for _, t in idle[:len(idle) // 2]:
                self.forget(t)

    def forget(self, tenant: str) -> None:
        self.service.pop(tenant, None)
        self.tokens.pop(tenant, None)

    def started(self, tenant: str) -> None:
        enter(self.running, tenant)
        if self.max_running and self.running[tenant] >= self.max_running:
            self.capped.add(tenant)

    def stopped(self, tenant: str) -> None:
        leave(self.running, tenant)
        if not (self.max_running and self.running.get(tenant, 0) >= self.max_running):
            self.capped.discard(tenant)

    def charge(self, tenant: str, prefill: int, decode: int) -> None:
        """Count tokens given to the tenant (negative: given back by a victim taken out of the step)."""
        w = self.token_weights
        self.service[tenant] = self.service.get(tenant, 0.0) + \
            (w.prefill * prefill + w.decode * decode) / self.weights.get(tenant, 1.0)
        self.tokens[tenant] = self.tokens.get(tenant, 0) + prefill + decode


class FairQueue:
    """Requests not running (waiting ones, and swapped-out ones waiting to come back), in the order
    (priority, tenant's service, arrival): priority first (lower runs first); among equal priorities
    the tenant with the least service, FCFS within it (a preempted request keeps its arrival and so
    its place among its tenant's). With one tenant, or fairness off: (priority, arrival).

    One heap per (priority, tenant) line and one heap of the lines by rank. A line's rank only grows
    (its tenant is served, its head leaves) except when a request lands ahead of its head or its
    tenant is given tokens back: those push a fresh entry, stamped, and older stamps are garbage.
    An entry that surfaces with a stale rank is renewed then (lazily), so a peek costs O(log lines)
    amortized, not O(queue) or O(tenants)."""

    def __init__(self, ledger: TenantLedger | None = None) -> None:
        self.ledger = ledger or TenantLedger(enabled=False)
        self._lines: dict[tuple[int, str], list[tuple[int, Request]]] = {}
        self._stamps: dict[tuple[int, str], int] = {}   # a line's current entry in _order
        self._order: list[tuple[int, float, int, str, int]] = []   # (priority, counter, head arrival, tenant, stamp)
        self._stamp = 0
        self._live = 0   # WAITING entries (swapped ones are counted by the scheduler's list)

    def push(self, request: Request) -> None:
        assert request.status in _QUEUED
        key = (request.priority, request.tenant)
        line = self._lines.setdefault(key, [])
        heapq.heappush(line, (request.arrival_seq, request))
        if line[0][1] is request:   # a new head: the line's rank may have fallen
            self._restamp(key)
        self._live += request.status == RequestStatus.WAITING

    def lowered(self, tenant: str) -> None:
        """The tenant's counter went down (tokens given back): its lines' ranks fell."""
        if self.ledger.enabled:
            for key in [k for k, line in self._lines.items() if k[1] == tenant and line]:
                self._restamp(key)

    def _restamp(self, key: tuple[int, str]) -> None:
        self._stamp += 1
        self._stamps[key] = self._stamp
        heapq.heappush(self._order, self._rank(key))
        if len(self._order) > 4 * len(self._lines) + 64:   # garbage: rebuild from the lines' current ranks
            for k in [k for k, line in self._lines.items() if not line]:
                del self._lines[k], self._stamps[k]
            self._order = [self._rank(k) for k in self._lines]
            heapq.heapify(self._order)

    def _rank(self, key: tuple[int, str]) -> tuple[int, float, int, str, int]:
        return key[0], self.ledger.counter(key[1]), self._lines[key][0][0], key[1], self._stamps[key]

    def _top(self, skip: frozenset[str] | set[str]) -> tuple[int, str] | None:
        """The best line whose tenant is not in `skip` (lines of skipped tenants stay queued)."""
        aside = []
        try:
            while self._order:
                entry = self._order[0]
                key = (entry[0], entry[3])
                if self._stamps.get(key) != entry[4]:   # an old entry of the line (or of a gone one)
                    heapq.heappop(self._order)
                    continue
                line = self._lines[key]
                while line and line[0][1].status not in _QUEUED:   # finished while queued
                    heapq.heappop(line)
                if not line:
                    heapq.heappop(self._order)
                    del self._lines[key], self._stamps[key]
                    continue
                rank = self._rank(key)
                if rank != entry:   # served since, or its head left: renew it
                    heapq.heapreplace(self._order, rank)
                    continue
                if entry[3] in skip:
                    aside.append(heapq.heappop(self._order))
                    continue
                return key
            return None
        finally:
            for entry in aside:
                heapq.heappush(self._order, entry)

    def peek(self, skip: frozenset[str] | set[str] = frozenset()) -> Request | None:
        key = self._top(skip)
        return self._lines[key][0][1] if key is not None else None

    def pop(self, skip: frozenset[str] | set[str] = frozenset()) -> Request:
        key = self._top(skip)
        assert key is not None, "pop from an empty queue"
        request = heapq.heappop(self._lines[key])[1]
        self._live -= request.status == RequestStatus.WAITING
        return request

    def take(self, request: Request, skip: frozenset[str] | set[str] = frozenset()) -> None:
        """Take out `request`, peeked as the head: popped while it is still the head (O(log)); taken
        from its line if the order moved since the peek (tokens given back, a cap lifted)."""
        key = self._top(skip)
        if key is not None and self._lines[key][0][1] is request:
            heapq.heappop(self._lines[key])
            self._live -= request.status == RequestStatus.WAITING
        else:
            self.remove(request)

    def remove(self, request: Request) -> None:
        """Take a queued request out now, wherever it stands (O(its line); for the rare paths that
        resume a request other than the head)."""
        key = (request.priority, request.tenant)
        line = self._lines.get(key, [])
        line[:] = [e for e in line if e[1] is not request]
        heapq.heapify(line)
        if line:
            self._restamp(key)
        self._live -= request.status == RequestStatus.WAITING

    def discard(self, request: Request) -> None:
        """Account for a waiting request that left (aborted); its heap entry is dropped lazily."""
        self._live -= 1

    def now_waiting(self, request: Request) -> None:
        """A queued swapped request turned into a waiting one (its KV was dropped)."""
        self._live += 1

    def __len__(self) -> int:
        return self._live
