"""A fixed pool of equal-size KV blocks with ref counts and a hash-addressed prefix cache.

A block is in exactly one place: owned (ref_count >= 1) or in the free queue. Free blocks
may still hold a cached prefix (their hash stays in ``cached``), so a later request can
revive them; the free queue is LRU, and a cached block is evicted only when it is taken
for new data. All operations are O(1) per block.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


@dataclass(slots=True)
class PoolStats:
    prefix_queries: int = 0   # blocks looked up
    prefix_hits: int = 0      # blocks found
    evictions: int = 0        # cached blocks overwritten


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        assert num_blocks > 0
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}   # block hash -> block id
        self.enable_caching = enable_caching
        self.stats = PoolStats()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int]:
        """Take n blocks (least recently freed first), evicting their cached contents."""
        if n > len(self.free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self.free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None
                self.stats.evictions += 1
            block.ref_count = 1
            out.append(block_id)
        return out

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash)

    def touch(self, block_id: int) -> None:
        """Add an owner to a (possibly free, cached) block."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one owner of each block; blocks reaching zero go to the free queue's tail.

        Callers pass a request's blocks tail-first so that a prefix's later blocks are
        evicted before its earlier (more shareable) ones.
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None or not self.enable_caching:
                    self._uncache(block)
                    self.free[block_id] = None
                    self.free.move_to_end(block_id, last=False)  # plain blocks are reused first
                else:
                    self.free[block_id] = None

    def register(self, block_id: int, block_hash: int) -> int:
        """Publish a full block under its hash; returns the block that now holds that hash."""
        if not self.enable_caching:
            return block_id
        existing = self.cached.get(block_hash)
        if existing is not None:
            return existing
        block = self.blocks[block_id]
        if block.block_hash is None:
            block.block_hash = block_hash
            self.cached[block_hash] = block_id
        return block_id

    def _uncache(self, block: Block) -> None:
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> None:
        for block_id in list(self.free):
            self._uncache(self.blocks[block_id])

    def check_invariants(self) -> None:
        for block in self.blocks:
            in_free = block.block_id in self.free
            assert in_free == (block.ref_count == 0), f"block {block.block_id}: ref {block.ref_count}, free {in_free}"
            assert block.ref_count >= 0
            if block.block_hash is not None:
                assert self.cached[block.block_hash] == block.block_id
        assert len(self.cached) == sum(b.block_hash is not None for b in self.blocks)
