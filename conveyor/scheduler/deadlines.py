"""Queue deadlines: a request that waited too long for its first scheduling fails instead of running late.

A request's queue limit is its own ``SamplingParams.max_queue_time``, capped by the engine's
``max_queue_time`` (``--max-queue-time``): a client may ask for a shorter wait than the server
allows, not a longer one. Its deadline is its arrival time plus that limit. Only a request
that has never been scheduled can expire: once it ran (even if a recompute preemption put it
back in the queue, or it waits swapped out) its deadline is void, since failing it then would
throw away work done and, when streaming, a response already under way. A follower of an
``n`` / ``best_of`` group whose leader has been scheduled counts as scheduled too (it only
waits for the leader's prefill to share its blocks).

The heap holds (deadline, arrival sequence, request id): no request objects, so finished
requests are not kept alive. Entries of requests that were scheduled or finished in the
meantime are dropped when their deadline comes up (each entry is pushed and popped once), and
the heap is compacted when such dead entries outnumber the live requests, so a step costs
O((expired + new) log n) amortised, never a scan of the whole queue. No torch here.
"""

from __future__ import annotations

import heapq

from conveyor.request import Request, RequestStatus

QUEUE_TIMEOUT = "queue_timeout"   # the error code of a request failed by its queue deadline

_COMPACT_SLACK = 1024   # dead entries tolerated beyond twice the live requests before a compaction


def queue_limit(request: Request, engine_limit: float | None) -> float | None:
    """Seconds the request may wait for its first scheduling (None: no limit)."""
    own = request.params.max_queue_time
    if own is None:
        return engine_limit
    return own if engine_limit is None else min(own, engine_limit)


def never_scheduled(request: Request) -> bool:
    """Still waiting for its first scheduling (what a queue deadline applies to)."""
    if request.status != RequestStatus.WAITING or request.metrics.first_scheduled_time is not None:
        return False
    leader = request.prefill_leader
    return leader is None or leader.metrics.first_scheduled_time is None


class DeadlineHeap:
    """Deadlines of the queued requests of one scheduler, earliest first."""

    def __init__(self, requests: dict[str, Request]):
        self._requests = requests   # the scheduler's live requests by id (read, never changed)
        self._heap: list[tuple[float, int, str]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, request: Request, engine_limit: float | None) -> None:
        """Register a request just queued (arrival time and sequence set); no-op without a limit."""
        limit = queue_limit(request, engine_limit)
        if limit is None:
            return
        heapq.heappush(self._heap, (request.arrival_time + limit, request.arrival_seq, request.request_id))
        if len(self._heap) > 2 * len(self._requests) + _COMPACT_SLACK:
            self._compact()

    def pop_expired(self, now: float) -> list[Request]:
        """The live, never-scheduled requests whose deadline is before `now`, removed from the heap."""
        expired = []
        heap = self._heap
        while heap and heap[0][0] < now:
            _, seq, rid = heapq.heappop(heap)
            request = self._live(rid, seq)
            if request is not None:
                expired.append(request)
        return expired

    def _live(self, rid: str, seq: int) -> Request | None:
        request = self._requests.get(rid)
        if request is None or request.arrival_seq != seq or not never_scheduled(request):
            return None   # finished, scheduled, or the id now names a later request
        return request

    def _compact(self) -> None:
        self._heap = [e for e in self._heap if self._live(e[2], e[1]) is not None]
        heapq.heapify(self._heap)


def timeout_message(request: Request, now: float, limit: float) -> str:
    return (f"queue timeout: the request waited {now - request.arrival_time:.3f} s without being scheduled, "
            f"longer than its max_queue_time of {limit:g} s; the server is overloaded, retry later")
