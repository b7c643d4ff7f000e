"""Stored Responses (``store: true``): an in-memory LRU bounded by entries and by bytes.

A stored response keeps its body (what GET returns), the conversation it continued plus its own
input items (what a later ``previous_response_id`` prepends) and, while it runs in the
background, its task. The least recently used entries are evicted once either bound is passed;
a response still running is never evicted (it is bounded by the engine's own queue instead), so
the store may exceed its bounds while many run at once. Nothing survives a restart.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

MAX_STORED_RESPONSES = 1024
MAX_STORED_BYTES = 64 << 20


@dataclass(slots=True)
class StoredResponse:
    body: dict[str, Any]                 # the Response object as GET returns it
    context: list[dict[str, Any]]        # input items: the continued conversation, then this request's own
    own_inputs: int                      # how many of `context` this request sent itself
    background: bool = False
    task: asyncio.Task | None = None     # the background generation, while it runs
    size: int = 0

    @property
    def running(self) -> bool:
        return self.body["status"] in ("queued", "in_progress")

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """What a follow-up's previous_response_id prepends: the input items, then the output items."""
        return self.context + self.body["output"]

    def measure(self) -> int:
        self.size = len(json.dumps(self.body)) + len(json.dumps(self.context))
        return self.size


@dataclass(slots=True)
class ResponseStore:
    max_entries: int = MAX_STORED_RESPONSES
    max_bytes: int = MAX_STORED_BYTES
    _entries: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)
    _bytes: int = 0

    def __post_init__(self) -> None:
        if self.max_entries < 1 or self.max_bytes < 1:
            raise ValueError("the response store needs room for at least one entry and one byte")

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def put(self, rid: str, entry: StoredResponse) -> None:
        """Add or re-measure an entry (most recently used), then evict down to the bounds."""
        old = self._entries.pop(rid, None)
        if old is not None:
            self._bytes -= old.size
        self._bytes += entry.measure()
        self._entries[rid] = entry
        self._evict()

    def get(self, rid: str) -> StoredResponse | None:
        entry = self._entries.get(rid)
        if entry is not None:
            self._entries.move_to_end(rid)
        return entry

    def delete(self, rid: str) -> StoredResponse | None:
        entry = self._entries.pop(rid, None)
        if entry is not None:
            self._bytes -= entry.size
        return entry

    def _evict(self) -> None:
        if len(self._entries) <= self.max_entries and self._bytes <= self.max_bytes:
            return
        for rid in [r for r, e in self._entries.items() if not e.running]:   # oldest first
            if len(self._entries) <= self.max_entries and self._bytes <= self.max_bytes:
                return
            self.delete(rid)
