"""The waiting queue: priority first (lower runs first), then arrival order (FCFS)."""

from __future__ import annotations

import heapq

from conveyor.request import Request, RequestStatus


class WaitQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Request]] = []
        self._live = 0

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_seq, request))
        self._live += 1

    def _drop_dead(self) -> None:
        while self._heap and self._heap[0][2].status != RequestStatus.WAITING:
            heapq.heappop(self._heap)

    def peek(self) -> Request | None:
        self._drop_dead()
        return self._heap[0][2] if self._heap else None

    def pop(self) -> Request:
        self._drop_dead()
        self._live -= 1
        return heapq.heappop(self._heap)[2]

    def discard(self, request: Request) -> None:
        """Account for a queued request that left (aborted); its heap entry is dropped lazily."""
        self._live -= 1

    def __len__(self) -> int:
        return self._live
