"""Swap: host-memory blocks and the requests swapped out to them.

The manager hands out block ids only; the executor owns the tensors and applies the copy
mappings that swap-out/swap-in return.
"""

from __future__ import annotations

from conveyor.kv.block_pool import BlockPool
from conveyor.kv.events import MEDIUM_HOST, KVEventRecorder
from conveyor.kv.prefix_cache import report_stored
from conveyor.request import Request


class HostPool:
    """Host-memory blocks that receive swapped-out KV. No caching, O(1) alloc/free.

    Blocks released by a swap-in are quarantined until the next step (``end_step``): the
    executor copies a step's swap-outs before its swap-ins, so a host block read by this
    step's swap-in must not be handed to a swap-out of the same step.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_ids = list(range(num_blocks - 1, -1, -1))
        self.quarantine: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self.free_ids)
        return [self.free_ids.pop() for _ in range(n)]

    def release(self, ids: list[int]) -> None:
        self.free_ids.extend(ids)

    def release_after_step(self, ids: list[int]) -> None:
        self.quarantine.extend(ids)

    def end_step(self) -> None:
        if self.quarantine:
            self.free_ids.extend(self.quarantine)
            self.quarantine.clear()


class SwapSpace:
    """Swapped-out requests: the host blocks holding their unshared KV, and their tables with None
    where a block went to the host; the blocks they share with others stay on the device, held by
    them (copying those would free nothing)."""

    def __init__(self, num_host_blocks: int, pool: BlockPool, null_block: int):
        self.host = HostPool(num_host_blocks)
        self.pool = pool
        self.null_block = null_block
        self.host_tables: dict[str, list[int]] = {}              # request id -> host block ids
        self.swapped_tables: dict[str, list[int | None]] = {}    # request id -> its table while swapped
        self.host_keys: dict[str, list[bytes]] = {}   # request id -> keys of its published blocks on the host

    def num_swapped_blocks(self, request_id: str) -> int:
        return len(self.host_tables.get(request_id, ()))

    def num_pinned(self, request_id: str) -> int:
        """Device blocks a swapped-out request still holds (shared with others)."""
        return sum(1 for b in self.swapped_tables.get(request_id, ()) if b is not None and b != self.null_block)

    def swap_out(self, request_id: str, table: list[int]) -> list[tuple[int, int]]:
        """Move the table's unshared blocks to host blocks; returns (device block, host block) copies."""
        blocks, null = self.pool.blocks, self.null_block
        moved = [b for b in table if b != null and blocks[b].ref_count == 1]
        host = self.host.allocate(len(moved))
        self.host_tables[request_id] = host
        self.swapped_tables[request_id] = [None if b != null and blocks[b].ref_count == 1 else b for b in table]
        self.pool.release(moved[::-1])
        return list(zip(moved, host))

    def swap_in(self, request_id: str, events: KVEventRecorder | None) -> tuple[list[int], list[tuple[int, int]]]:
        """The request's table back on the device, and the (host block, device block) copies."""
        host = self.host_tables.pop(request_id)
        fresh = iter(self.pool.allocate(len(host)))
        new = []
        table = []
        for b in self.swapped_tables.pop(request_id):
            if b is None:
                b = next(fresh)
                new.append(b)
            table.append(b)
        self.host.release_after_step(host)
        self._left_host(request_id, events)
        return table, list(zip(host, new))

    def release(self, request_id: str, events: KVEventRecorder | None) -> None:
        """The request is freed: its host blocks, and the device blocks it kept while swapped."""
        host = self.host_tables.pop(request_id, None)
        if host:
            self.host.release(host)
        self._left_host(request_id, events)
        pinned = self.swapped_tables.pop(request_id, None)
        if pinned:
            self.pool.release([b for b in pinned[::-1] if b is not None and b != self.null_block])

    def _left_host(self, request_id: str, events: KVEventRecorder | None) -> None:
        if events is not None and request_id in self.host_keys:
            events.removed(self.host_keys.pop(request_id), MEDIUM_HOST)

    def report_swapped_out(self, events: KVEventRecorder, request: Request, table: list[int],
                           hashes: list[bytes], num_groups: int, block_size: int) -> None:
        """Events: the request's published blocks that swap-out copies to the host (its unshared
        ones; call before swap_out)."""
        blocks = self.pool.blocks
        on_host, run = [], None
        for i, b in enumerate(table[::num_groups] + [None]):   # group 0's blocks
            moved = (b is not None and b != self.null_block and i < len(hashes) and blocks[b].ref_count == 1
                     and blocks[b].block_hash == hashes[i])
            if moved:
                on_host.append(hashes[i])
                run = i if run is None else run
            elif run is not None:
                report_stored(events, request, hashes, run, i, block_size, MEDIUM_HOST)
                run = None
        if on_host:
            self.host_keys[request.request_id] = on_host

    def check_invariants(self) -> None:
        host_used = sum(len(t) for t in self.host_tables.values())
        assert host_used + self.host.num_free + len(self.host.quarantine) == self.host.num_blocks
        assert set(self.swapped_tables) == set(self.host_tables)
        for rid, table in self.swapped_tables.items():
            assert table.count(None) == len(self.host_tables[rid])
