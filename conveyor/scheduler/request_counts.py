"""Requests (not sequences) live in the scheduler and with a sequence running, kept as sequences come
and go: O(1) per change, so a step's stats never walk the queue.

An n > 1 request's sequences share their first sequence (``prefill_leader``) and count once; a
request with any sequence running is running, the others are queued (vLLM's request gauges).
"""

from __future__ import annotations

from collections import Counter

from conveyor.request import Request


class RequestCounts:
    __slots__ = ("live", "running", "_live", "_running")

    def __init__(self):
        self.live = 0        # requests with a sequence in the scheduler
        self.running = 0     # of those, with a sequence in the running batch
        self._live: Counter[str] = Counter()      # leader id -> its sequences in the scheduler
        self._running: Counter[str] = Counter()   # leader id -> its sequences running

    @staticmethod
    def _key(seq: Request) -> str:
        return (seq.prefill_leader or seq).request_id

    def added(self, seq: Request) -> None:
        self.live += _enter(self._live, self._key(seq))

    def removed(self, seq: Request) -> None:
        self.live -= _leave(self._live, self._key(seq))

    def started(self, seq: Request) -> None:
        self.running += _enter(self._running, self._key(seq))

    def stopped(self, seq: Request) -> None:
        self.running -= _leave(self._running, self._key(seq))


def _enter(counts: Counter[str], key: str) -> int:
    """1 when `key` had no sequence before, else 0."""
    counts[key] += 1
    return counts[key] == 1


def _leave(counts: Counter[str], key: str) -> int:
    """1 when `key`'s last sequence left, else 0."""
    counts[key] -= 1
    assert counts[key] >= 0, key
    if counts[key]:
        return 0
    del counts[key]
    return 1
