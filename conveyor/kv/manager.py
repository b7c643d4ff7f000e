"""The KV cache manager: per-request block tables over the device block pool, coordinating the
parts that each do one job:

- ``block_pool.py``: the device blocks (ref counts, LRU free queue, the verified key -> block map);
- ``block_keys.py``: the sha256-chained key of each full block of a request;
- ``prefix_cache.py``: prefix-cache lookups and publication, hit accounting;
- ``attention_kinds.py``: one manager per layer group by its attention kind (full or sliding
  window): what its column of a table holds, reuses and gives back;
- ``host_pool.py``: swap, the host blocks and the requests swapped out to them.

The manager hands out block ids only; the executor owns the tensors and applies the copy
mappings that swap-out/swap-in return.
"""

from __future__ import annotations

from collections.abc import Callable

from conveyor.kv.attention_kinds import group_managers
from conveyor.kv.block_pool import BlockPool, PoolStats
from conveyor.kv.events import KVEventRecorder
from conveyor.kv.host_pool import HostPool, SwapSpace
from conveyor.kv.layout import KVLayout, cdiv
from conveyor.kv.block_keys import ROOT_HASH, BlockKeys, block_content, chain_hash, extra_keys
from conveyor.kv.prefix_cache import NO_PREFIX, CachedPrefix, PrefixCache, as_hit
from conveyor.request import Request

__all__ = ["KVCacheManager", "CachedPrefix", "NO_PREFIX", "BlockKeys", "HostPool", "ROOT_HASH",
           "block_content", "chain_hash", "extra_keys", "cdiv"]


class KVCacheManager:
    """Block tables per layer group (conveyor/kv/layout.py; one group unless the model has
    sliding-window layers), kept interleaved in one list per request."""

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True, layout: KVLayout | None = None):
        self.block_size = block_size
        self.layout = layout = layout or KVLayout.single(1)
        self.num_groups = layout.num_groups
        self.windows = layout.windows
        # Where a local group gave a block back: a block id past the pool, never written (zeros).
        self.null_block = num_blocks if layout.windowed else -1
        self.kinds = group_managers(layout, block_size, self.null_block)   # per group: its attention kind
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.prefix = PrefixCache(self.pool, self.kinds, block_size, self.null_block)
        self.swap = SwapSpace(num_host_blocks, self.pool, self.null_block)
        self.host = self.swap.host
        self.tables: dict[str, list[int]] = {}       # request id -> device block ids
        self.num_null: dict[str, int] = {}           # request id -> null entries in its table
        # The parts' per-request state, under the names callers and checks read.
        self.host_tables = self.swap.host_tables     # request id -> host block ids (while swapped)
        self.swapped_tables = self.swap.swapped_tables   # ... its table, None where a block went to the host
        self.host_keys = self.swap.host_keys         # ... keys of its published blocks on the host
        self.hashes = self.prefix.hashes             # request id -> keys (chained sha256) of its full blocks
        self.num_registered = self.prefix.num_registered   # ... leading blocks published in the cache
        self.chain_parent = self.prefix.chain_parent       # ... per group: where its chain of publications stands
        self.group_hits = self.prefix.group_hits     # per group: blocks it alone could have supplied
        # KV events (conveyor/kv/events.py): None unless enabled, and then every hook is skipped.
        self.events: KVEventRecorder | None = None

    def enable_events(self, recorder: KVEventRecorder) -> None:
        """Report blocks entering and leaving the prefix cache (and host memory) to `recorder`."""
        self.events = recorder
        # Events speak for group 0 only (its keys are the plain 32-byte ones; other groups' carry a tag).
        self.pool.on_remove = lambda key: recorder.removed((key,)) if len(key) == 32 else None

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_for(self, num_tokens: int, num_computed: int | None = None, chunk: int = 1) -> int:
        """Blocks (all groups) a sequence of num_tokens holds: once num_computed of them are
        computed, or (None) at most over its life in chunks of up to `chunk` tokens
        (KVLayout.blocks_for)."""
        if self.layout.trivial:
            return cdiv(num_tokens, self.block_size)
        return self.layout.blocks_for(num_tokens, self.block_size, num_computed, chunk)

    @property
    def max_tokens(self) -> int:
        """The longest sequence the whole cache can hold."""
        return self.layout.max_tokens(self.num_blocks, self.block_size)

    def max_chunk(self, num_computed: int) -> int:
        """The most tokens one chunk starting at num_computed can take with the whole cache to itself:
        a local group holds the chunk's blocks until the step is done, even those whose tokens
        leave its window within the chunk (at least 1: a sequence that fits nowhere cannot run)."""
        dropped = sum(kind.dropped(num_computed) for kind in self.kinds)
        return max(1, (self.num_blocks + dropped) // self.num_groups * self.block_size - num_computed)

    def num_held(self, request_id: str) -> int:
        table = self.tables.get(request_id)
        return len(table) - self.num_null.get(request_id, 0) if table else 0

    def block_table(self, request_id: str) -> list[int]:
        return self.tables[request_id]

    @property
    def enable_prefix_caching(self) -> bool:
        return self.pool.enable_caching

    @property
    def num_host_blocks(self) -> int:
        return self.host.num_blocks

    @property
    def num_free_host_blocks(self) -> int:
        return self.host.num_free

    def num_swapped_blocks(self, request_id: str) -> int:
        """Host blocks holding a swapped-out request's KV (0 if it is not swapped out)."""
        return self.swap.num_swapped_blocks(request_id)

    def ref_count(self, block_id: int) -> int:
        return self.pool.blocks[block_id].ref_count

    def is_cached(self, block_id: int) -> bool:
        """The block is published in the prefix cache (its contents must not change)."""
        return self.pool.blocks[block_id].block_hash is not None

    def num_revived(self, cached: CachedPrefix) -> int:
        """Prefix-cache hits that sit in the free queue: taking them uses up free blocks."""
        blocks = self.pool.blocks
        return sum(1 for b in cached if b != self.null_block and blocks[b].ref_count == 0)

    @property
    def prefix_cache_stats(self) -> PoolStats:
        return self.pool.stats

    # ---- prefix cache --------------------------------------------------------------------
    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """Cached blocks matching the longest prefix of the request's tokens in every group
        (PrefixCache.find); at least one token is always left to compute."""
        return self.prefix.find(request)

    def record_prefix_lookup(self, request: Request, cached: CachedPrefix) -> None:
        """Count one admission's lookup (done once, not on every deferred retry)."""
        self.prefix.record_lookup(request, cached)

    def publish_full_blocks(self, request: Request) -> None:
        """Put the request's newly completed blocks into the prefix cache (every group's)."""
        if not self.pool.enable_caching:
            return
        table = self.tables.get(request.request_id)
        if table:
            self.prefix.publish(request, table, self.events)

    def num_shared_prefix_tokens(self, request: Request) -> int:
        """Tokens of the request's leading blocks that others hold too: they stay cached when it
        is preempted, so recomputing it starts after them (a prefix-cache hit)."""
        if not self.prefix.reads(request):
            return 0
        whole = [g for g, kind in enumerate(self.kinds) if kind.keeps_whole_prefix]
        if not whole:   # what a local group gave back decides: assume nothing stays
            return 0
        # Layer groups: the global groups' blocks (a local group's at the hit's end may have been
        # given back; then more is recomputed than this says).
        table, G, blocks = self.tables.get(request.request_id, ()), self.num_groups, self.pool.blocks
        n = 0
        for i in range(0, len(table), G):
            if any(blocks[table[i + g]].ref_count < 2 or blocks[table[i + g]].block_hash is None for g in whole):
                break
            n += 1
        limit = request.cacheable_prefix
        shared = min(n * self.block_size, max(0, request.num_tokens - 1))
        return shared if limit is None else min(shared, limit // self.block_size * self.block_size)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix that no request holds; True if nothing is cached any more
        (then the events say AllBlocksCleared, else which blocks left)."""
        self.pool.reset_prefix_cache()
        empty = not self.pool.cached
        if self.events is not None and empty and not self.host_keys:
            self.events.pending.clear()   # whatever this step stored or removed is gone now
            self.events.cleared()
        return empty

    # ---- allocation ----------------------------------------------------------------------
    def blocks_needed(self, request: Request, num_new_tokens: int, cached: CachedPrefix = NO_PREFIX) -> int:
        """Pool blocks that growing the request's tables to num_computed + num_new_tokens takes."""
        have = len(self.tables.get(request.request_id, ())) // self.num_groups + as_hit(cached).num_blocks
        want = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, want - have) * self.num_groups

    def can_allocate(self, n: int, cached: CachedPrefix = NO_PREFIX) -> bool:
        # Cached hits that sit in the free queue are taken out of it when touched.
        return n + self.num_revived(cached) <= self.pool.num_free

    def allocate(self, request: Request, num_new_tokens: int, cached: CachedPrefix = NO_PREFIX) -> bool:
        """Grow the request's tables to hold num_computed + num_new_tokens. All or nothing."""
        cached = as_hit(cached)
        need = self.blocks_needed(request, num_new_tokens, cached)
        if not self.can_allocate(need, cached):
            return False
        rid = request.request_id
        table = self.tables.setdefault(rid, [])
        if cached.num_blocks:
            for block_id in cached:
                if block_id != self.null_block:
                    self.pool.touch(block_id)
            table.extend(cached)
            self.num_null[rid] = len(cached) - cached.pages
            self.prefix.adopt(rid, cached)
        table.extend(self.pool.allocate(need))
        return True

    def trim(self, request: Request, num_tokens: int) -> bool:
        """Give back the blocks past the first num_tokens positions (speculative decoding: slots
        allocated for drafts that were refused; such blocks were never full of computed tokens, so
        never published). Returns whether the table shrank."""
        table = self.tables.get(request.request_id)
        if not table:
            return False
        G = self.num_groups
        excess = len(table) // G - cdiv(num_tokens, self.block_size)
        if excess <= 0:
            return False
        tail = table[len(table) - excess * G:]
        del table[len(table) - excess * G:]
        assert self.null_block not in tail
        self.pool.release(tail[::-1])
        return True

    def slide(self, request: Request) -> None:
        """Give back the blocks of local groups that left the window: no query from the request's
        next token on can see them (call once its computed tokens advanced)."""
        if not self.layout.windowed:
            return
        rid = request.request_id
        table = self.tables.get(rid)
        if not table:
            return
        freed = sum(kind.slide(self.pool, table, self.num_groups, request.num_computed_tokens) for kind in self.kinds)
        if freed:
            self.num_null[rid] = self.num_null.get(rid, 0) + freed

    def free(self, request: Request) -> None:
        rid = request.request_id
        table = self.tables.pop(rid, None)
        if table:
            null = self.null_block
            self.pool.release([b for b in table[::-1] if b != null])
        self.swap.release(rid, self.events)
        self.prefix.drop(rid)
        self.num_null.pop(rid, None)

    def forget(self, request: Request) -> None:
        """Drop a finished request's cached block keys."""
        self.prefix.forget(request.request_id)

    # ---- swap ----------------------------------------------------------------------------
    def num_unshared(self, request_id: str) -> int:
        """Blocks that only this request holds: what preempting it (either way) frees."""
        blocks, null = self.pool.blocks, self.null_block
        return sum(1 for b in self.tables.get(request_id, ()) if b != null and blocks[b].ref_count == 1)

    def blocks_freed_by(self, requests: list[Request], swaps: Callable[[Request], bool],
                        keep: set[int] | frozenset = frozenset()) -> list[int]:
        """For running requests preempted in this order: the blocks each one's preemption frees.
        Recompute drops all its blocks, so a block shared only among them is freed by the last of
        them to go; swap (if `swaps(request)` and the host pool still has room for what it would
        copy) frees only the blocks nobody else holds at that moment and keeps the shared ones.
        Blocks in `keep` are not counted."""
        dropped: dict[int, int] = {}
        blocks, null = self.pool.blocks, self.null_block
        host_free = self.host.num_free
        out = []
        for r in requests:
            table = [b for b in self.tables.get(r.request_id, ()) if b != null]
            last = [b for b in table if dropped.get(b, 0) + 1 == blocks[b].ref_count]
            swap = len(last) <= host_free and swaps(r)
            if swap:
                host_free -= len(last)
            for b in (last if swap else table):
                dropped[b] = dropped.get(b, 0) + 1
            out.append(sum(1 for b in last if b not in keep))
        return out

    def num_pinned(self, request_id: str) -> int:
        """Device blocks a swapped-out request still holds (shared with others)."""
        return self.swap.num_pinned(request_id)

    def can_swap_out(self, request: Request) -> bool:
        return self.num_unshared(request.request_id) <= self.host.num_free

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's unshared KV to host blocks; returns (device block, host block) copies.
        Shared blocks stay on the device, held by the swapped request."""
        rid = request.request_id
        table = self.tables.pop(rid)
        if self.events is not None:
            keys = self.hashes.get(rid)
            self.swap.report_swapped_out(self.events, request, table, keys.hashes if keys is not None else [],
                                         self.num_groups, self.block_size)
        copies = self.swap.swap_out(rid, table)
        self.prefix.unpublished(rid)
        return copies

    def can_swap_in(self, request: Request) -> bool:
        return len(self.host_tables[request.request_id]) <= self.pool.num_free

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring the request's KV back; returns (host block, device block) copies."""
        rid = request.request_id
        self.tables[rid], copies = self.swap.swap_in(rid, self.events)
        return copies

    def end_step(self) -> None:
        """A step's plan is complete: host blocks its swap-ins read may serve the next step's swap-outs."""
        self.host.end_step()

    def check_invariants(self, live_ids: set[str] | None = None) -> None:
        self.pool.check_invariants()
        owners: dict[int, int] = {}
        null = self.null_block
        for table in [*self.tables.values(), *self.swapped_tables.values()]:
            assert len(table) % self.num_groups == 0
            for b in table:
                if b is not None and b != null:
                    owners[b] = owners.get(b, 0) + 1
        for rid, table in self.tables.items():
            assert table.count(null) == self.num_null.get(rid, 0), f"{rid}: null entries miscounted"
        for block in self.pool.blocks:
            assert block.ref_count == owners.get(block.block_id, 0), \
                f"block {block.block_id}: ref {block.ref_count} != owners {owners.get(block.block_id, 0)}"
        self.swap.check_invariants()
        if live_ids is not None:
            assert set(self.tables) | set(self.host_tables) <= live_ids
