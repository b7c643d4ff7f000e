"""A fixed pool of equal-size KV blocks with ref counts and a hash-addressed prefix cache.

A block is in exactly one place: owned (ref_count >= 1) or in the free queue. Free blocks
may still hold a cached prefix (their hash stays in ``cached``), so a later request can
revive them; the free queue is LRU, and a cached block is evicted only when it is taken
for new data. All operations are O(1) per block.

The hash only finds a candidate; it is never trusted alone. A published block keeps the
bytes its key covers (``content``: extra keys such as the cache salt, and its token ids) and
the publication it was computed after (``parent``, a publication id: one id per token
sequence, never given to another), and ``match``/``register`` accept a block only if both are
equal. So even a hash collision (forced
or not) cannot hand one sequence the KV of different tokens, or of the same tokens after a
different prefix: it becomes a miss.

A publication id names a token sequence (with its salt), not a block: when a key is published
again with the same content and parent as its last evicted holder (kept in ``retired``, at
most one entry per block), the id is reused, so cached blocks that were computed after the
evicted one still match after the re-publication.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None   # its key in the prefix cache while published
    content: bytes = b""              # what the key covers besides the parent: extra keys + token ids
    parent: int = 0                   # publication it was computed after (0: the start of a sequence)
    pub_id: int = 0                   # its publication id: names its token sequence (0: unpublished)
    # while published: the prompt logprobs of the tokens it holds, as (top-k count, one entry per
    # token), when a request that asked for them computed it (prefix_cache.py); None otherwise
    logprobs: tuple[int, list] | None = None


@dataclass(slots=True)
class PoolStats:
    prefix_queries: int = 0   # blocks looked up
    prefix_hits: int = 0      # blocks found
    evictions: int = 0        # cached blocks overwritten
    mismatches: int = 0       # a key led to a block with other content or parent (collision or stale): a miss


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        assert num_blocks > 0
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}   # block hash -> block id
        self.enable_caching = enable_caching
        self._last_pub = 0
        # key -> (content, parent, publication id) of its last evicted holder, oldest first
        self.retired: OrderedDict[bytes, tuple[bytes, int, int]] = OrderedDict()
        self.stats = PoolStats()
        self.on_remove: Callable[[bytes], None] | None = None   # told each key that leaves the cache (KV events)

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
                self._uncache(block)
                self.stats.evictions += 1
            block.ref_count = 1
            out.append(block_id)
        return out

    def lookup(self, block_hash: bytes) -> int | None:
        """The block published under this key, unverified (see ``match``)."""
        return self.cached.get(block_hash)

    def match(self, block_hash: bytes, content: bytes, parent: int) -> int | None:
        """The block published under this key if it holds exactly `content` computed after
        publication `parent`; None otherwise (a miss, even when the key is there)."""
        block_id = self.cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.content != content or block.parent != parent:
            self.stats.mismatches += 1
            return None
        return block_id

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

    def register(self, block_id: int, block_hash: bytes, content: bytes = b"", parent: int = 0) -> int | None:
        """Publish a full block (holding `content`, computed after publication `parent`) under
        its hash. Returns the block that now holds this content under that key: this one, or an
        earlier holder of the same content and parent (the duplicate is not published). Returns
        None, publishing nothing, if the key is held by a block in use with other content or
        parent (a collision); a free holder that does not match (stale, or a collision) gives
        its key up to this block."""
        if not self.enable_caching:
            return block_id
        existing = self.cached.get(block_hash)
        if existing is not None:
            holder = self.blocks[existing]
            if holder.content == content and holder.parent == parent:
                return existing
            self.stats.mismatches += 1
            if holder.ref_count > 0:
                return None
            self._uncache(holder)
            self.free.move_to_end(existing, last=False)   # plain now: reused first
        block = self.blocks[block_id]
        if block.block_hash is not None:   # already published under another key: cannot vouch
            return None
        old = self.retired.pop(block_hash, None)
        if old is not None and old[0] == content and old[1] == parent:
            pub_id = old[2]   # the same sequence as the evicted holder: its cached successors still match
        else:
            self._last_pub += 1
            pub_id = self._last_pub
        block.block_hash, block.content, block.parent, block.pub_id = block_hash, content, parent, pub_id
        self.cached[block_hash] = block_id
        return block_id

    def _uncache(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.on_remove is not None:
                self.on_remove(block.block_hash)
            del self.cached[block.block_hash]
            self.retired.pop(block.block_hash, None)
            self.retired[block.block_hash] = (block.content, block.parent, block.pub_id)
            if len(self.retired) > len(self.blocks):
                self.retired.popitem(last=False)
            block.block_hash, block.content, block.parent, block.pub_id = None, b"", 0, 0
            block.logprobs = None

    def reset_prefix_cache(self) -> None:
        for block_id in list(self.free):
            self._uncache(self.blocks[block_id])
        self.retired.clear()

    def check_invariants(self) -> None:
        for block in self.blocks:
            in_free = block.block_id in self.free
            assert in_free == (block.ref_count == 0), f"block {block.block_id}: ref {block.ref_count}, free {in_free}"
            assert block.ref_count >= 0
            if block.block_hash is not None:
                assert self.cached[block.block_hash] == block.block_id
                assert 0 < block.parent < block.pub_id or block.parent == 0 < block.pub_id
            else:
                assert block.pub_id == block.parent == 0 and not block.content
        assert len(self.cached) == sum(b.block_hash is not None for b in self.blocks)
        live = [b.pub_id for b in self.blocks if b.block_hash is not None]
        assert len(set(live)) == len(live), "two cached blocks share a publication id"
        assert len(self.retired) <= len(self.blocks)
