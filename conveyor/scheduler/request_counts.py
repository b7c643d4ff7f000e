"""Requests (not sequences) live in the scheduler and with a sequence running, kept as sequences come
and go: O(1) per change, so a step's stats never walk the queue.

An n > 1 request's sequences share their first sequence (``prefill_leader``) and count once; a
request with any sequence running is running, the others are queued (vLLM's request gauges).
"""

from __future__ import annotations

from collections import Counter

from conveyor.request import Request


class RequestCounts:
    __slots__ = ("live", "running", "_live", "_running", "lora_live", "lora_running")

    def __init__(self):
        self.live = 0        # requests with a sequence in the scheduler
        self.running = 0     # of those, with a sequence in the running batch
        self._live: Counter[str] = Counter()      # leader id -> its sequences in the scheduler
        self._running: Counter[str] = Counter()   # leader id -> its sequences running
        self.lora_live: Counter[str] = Counter()      # LoRA adapter name -> its sequences in the scheduler
        self.lora_running: Counter[str] = Counter()   # ... running

    @property
    def lora_waiting(self) -> list[str]:
        """Adapters with a sequence queued (vLLM's waiting_lora_adapters)."""
        return sorted(a for a, n in self.lora_live.items() if n > self.lora_running.get(a, 0))

    @staticmethod
    def _key(seq: Request) -> str:
        return (seq.prefill_leader or seq).request_id

    def added(self, seq: Request) -> None:
        self.live += enter(self._live, self._key(seq))
        if seq.lora is not None:
            enter(self.lora_live, seq.lora.lora_name)

    def removed(self, seq: Request) -> None:
        self.live -= leave(self._live, self._key(seq))
        if seq.lora is not None:
            leave(self.lora_live, seq.lora.lora_name)

    def started(self, seq: Request) -> None:
        self.running += enter(self._running, self._key(seq))
        if seq.lora is not None:
            enter(self.lora_running, seq.lora.lora_name)

    def stopped(self, seq: Request) -> None:
        self.running -= leave(self._running, self._key(seq))
        if seq.lora is not None:
            leave(self.lora_running, seq.lora.lora_name)


def enter(counts: Counter[str], key: str) -> int:
    """1 when `key` had no sequence before, else 0."""
    counts[key] += 1
    return counts[key] == 1


def leave(counts: Counter[str], key: str) -> int:
    """1 when `key`'s last sequence left, else 0."""
    counts[key] -= 1
    assert counts[key] >= 0, key
    if counts[key]:
        return 0
    del counts[key]
    return 1
