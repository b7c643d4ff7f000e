"""The queue: requests not running (waiting ones, and swapped-out ones waiting to come back),
priority first (lower runs first), then arrival order (FCFS). A preempted request keeps its
(priority, arrival) and so its place."""

from __future__ import annotations

import heapq

from conveyor.request import Request, RequestStatus

_QUEUED = (RequestStatus.WAITING, RequestStatus.SWAPPED)


class WaitQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Request]] = []
        self._live = 0   # WAITING entries (swapped ones are counted by the scheduler's list)

    def push(self, request: Request) -> None:
        assert request.status in _QUEUED
        heapq.heappush(self._heap, (request.priority, request.arrival_seq, request))
        self._live += request.status == RequestStatus.WAITING

    def _drop_dead(self) -> None:
        while self._heap and self._heap[0][2].status not in _QUEUED:
            heapq.heappop(self._heap)

    def peek(self) -> Request | None:
        self._drop_dead()
        return self._heap[0][2] if self._heap else None

    def pop(self) -> Request:
        self._drop_dead()
        request = heapq.heappop(self._heap)[2]
        self._live -= request.status == RequestStatus.WAITING
        return request

    def remove(self, request: Request) -> None:
        """Take a queued request out now, wherever it stands (O(queue); for the rare paths that
        resume a request other than the head)."""
        self._heap = [e for e in self._heap if e[2] is not request]
        heapq.heapify(self._heap)
        self._live -= request.status == RequestStatus.WAITING

    def discard(self, request: Request) -> None:
        """Account for a waiting request that left (aborted); its heap entry is dropped lazily."""
        self._live -= 1

    def now_waiting(self, request: Request) -> None:
        """A queued swapped request turned into a waiting one (its KV was dropped)."""
        self._live += 1

    def __len__(self) -> int:
        return self._live
