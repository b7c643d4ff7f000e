"""One manager per layer group, by the group's kind of attention: what its column of a request's
block table holds, which cached blocks it can reuse, and which blocks it gives back.

The coordinator (manager.py) keeps a request's tables interleaved (logical block `b` of group `g`
is entry ``b * num_groups + g``, layout.py) and asks each group's manager, in group order, about
its column:

- ``FullAttentionManager`` (window 0): a query sees every earlier token, so the group holds every
  block of the sequence, and a cached prefix is usable only as an unbroken chain of verified
  publications from the first block on.
- ``SlidingWindowManager``: a query sees the last `window` tokens, so blocks that left the window
  go back to the pool (their entries become the null block), and a cached prefix needs only the
  blocks its window sees from the prefix's end. The group keeps nothing before its window, so it
  cannot verify a block's parent publication: its content carries the parent's key instead.
"""

from __future__ import annotations

from conveyor.kv.block_pool import BlockPool
from conveyor.kv.layout import KVLayout
from conveyor.kv.block_keys import BlockKeys


class PrefixLookup:
    """One group's side of a prefix-cache lookup over a request's first `n` full blocks."""

    bound: int   # no prefix longer than this is usable, whatever the other groups hold
    hits: int    # blocks this group alone could supply

    def fits(self, m: int) -> int:
        """The longest prefix <= m blocks this group can supply."""
        raise NotImplementedError

    def blocks(self, m: int) -> list[int]:
        """This group's column of the hit for an m-block prefix that it fits."""
        raise NotImplementedError


class GroupManager:
    """A layer group's column of the block tables."""

    keeps_whole_prefix = True   # holds every block of a sequence while it runs

    def __init__(self, group: int, window: int, block_size: int, layout: KVLayout, null_block: int):
        self.group = group
        self.window = window
        self.block_size = block_size
        self.layout = layout
        self.null_block = null_block
        self.tag = b"" if group == 0 else bytes((group,))   # group 0 uses the plain keys, others tag them

    def key(self, keys: BlockKeys, i: int) -> tuple[bytes, bytes]:
        """This group's cache key and verified content for the request's block i."""
        return keys.hashes[i] + self.tag, self.content(keys, i)

    def content(self, keys: BlockKeys, i: int) -> bytes:
        raise NotImplementedError

    def dropped(self, num_computed: int) -> int:
        """Leading blocks no query from position `num_computed` on can see."""
        return 0

    def lookup(self, pool: BlockPool, keys: BlockKeys, n: int) -> PrefixLookup:
        raise NotImplementedError

    def can_publish(self, parent: int | None) -> bool:
        """A block computed after publication `parent` (None: its chain broke) may be published."""
        return True

    def publish(self, pool: BlockPool, block_id: int, key: bytes, content: bytes,
                parent: int | None) -> tuple[int | None, int | None]:
        """Publish a full block; returns the block now holding its content (None: a collision kept
        it out) and the publication the group's next block is computed after."""
        raise NotImplementedError

    def parent_after(self, pool: BlockPool, block_id: int) -> int:
        """The publication a block following this (cached) one is computed after."""
        return 0

    def slide(self, pool: BlockPool, table: list[int], num_groups: int, num_computed: int) -> int:
        """Give back the blocks that left the window; returns how many."""
        return 0


class _ChainLookup(PrefixLookup):
    def __init__(self, found: list[int]):
        self.found = found
        self.bound = self.hits = len(found)

    def fits(self, m: int) -> int:
        return min(m, self.bound)

    def blocks(self, m: int) -> list[int]:
        return self.found[:m]


class FullAttentionManager(GroupManager):
    def content(self, keys: BlockKeys, i: int) -> bytes:
        return keys.contents[i]

    def lookup(self, pool: BlockPool, keys: BlockKeys, n: int) -> PrefixLookup:
        """The chain of verified hits from the first block on: each the same content (tokens, salt)
        computed after the block matched just before it."""
        found, parent = [], 0
        for i in range(n):
            block_id = pool.match(*self.key(keys, i), parent)
            if block_id is None:
                break
            found.append(block_id)
            parent = pool.blocks[block_id].pub_id
        return _ChainLookup(found)

    def can_publish(self, parent: int | None) -> bool:
        return parent is not None

    def publish(self, pool: BlockPool, block_id: int, key: bytes, content: bytes,
                parent: int | None) -> tuple[int | None, int | None]:
        holder = pool.register(block_id, key, content, parent)
        return holder, None if holder is None else pool.blocks[holder].pub_id

    def parent_after(self, pool: BlockPool, block_id: int) -> int:
        return pool.blocks[block_id].pub_id


class _WindowLookup(PrefixLookup):
    def __init__(self, kind: SlidingWindowManager, pool: BlockPool, keys: BlockKeys, n: int):
        self.kind, self.pool, self.keys = kind, pool, keys
        self.found: dict[int, int | None] = {}   # block index -> the cached block, probed once
        self.bound = n
        self.hits = self.fits(n)

    def present(self, i: int) -> int | None:
        if i not in self.found:
            self.found[i] = self.pool.match(*self.kind.key(self.keys, i), 0)
        return self.found[i]

    def fits(self, m: int) -> int:
        """The largest prefix <= m blocks whose window blocks the group holds."""
        while m > 0:
            lo = self.kind.dropped(m * self.kind.block_size)
            miss = next((j for j in range(m - 1, lo - 1, -1) if self.present(j) is None), None)
            if miss is None:
                return m
            m = miss   # every prefix longer than the miss still sees it
        return 0

    def blocks(self, m: int) -> list[int]:
        lo = self.kind.dropped(m * self.kind.block_size)
        return [self.kind.null_block] * lo + [self.found[b] for b in range(lo, m)]


class SlidingWindowManager(GroupManager):
    keeps_whole_prefix = False

    def content(self, keys: BlockKeys, i: int) -> bytes:
        return keys.parent_key(i) + keys.contents[i]

    def dropped(self, num_computed: int) -> int:
        return self.layout.dropped(self.window, num_computed, self.block_size)

    def lookup(self, pool: BlockPool, keys: BlockKeys, n: int) -> PrefixLookup:
        return _WindowLookup(self, pool, keys, n)

    def publish(self, pool: BlockPool, block_id: int, key: bytes, content: bytes,
                parent: int | None) -> tuple[int | None, int | None]:
        return pool.register(block_id, key, content, 0), 0   # its chain is in the content

    def slide(self, pool: BlockPool, table: list[int], num_groups: int, num_computed: int) -> int:
        # The given-back blocks are a leading run of nulls: walk back from the window's start to
        # that run (O(blocks given back now)), then give them back oldest first.
        G, g, null = num_groups, self.group, self.null_block
        b = min(self.dropped(num_computed), len(table) // G)
        going = []
        while b > 0 and table[(b - 1) * G + g] != null:
            b -= 1
            going.append(b * G + g)
        for i in reversed(going):
            pool.release([table[i]])
            table[i] = null
        return len(going)


def group_managers(layout: KVLayout, block_size: int, null_block: int) -> list[GroupManager]:
    """Each layer group's manager, in group order."""
    return [(SlidingWindowManager if w else FullAttentionManager)(g, w, block_size, layout, null_block)
            for g, w in enumerate(layout.windows)]
