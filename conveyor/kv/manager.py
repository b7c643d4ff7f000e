"""Per-request block tables on top of the device block pool, prefix-cache lookups, and swap.

The manager hands out block ids only; the executor owns the tensors and applies the copy
mappings that swap-out/swap-in return.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from conveyor.kv.block_pool import BlockPool, PoolStats
from conveyor.kv.events import MEDIUM_DEVICE, MEDIUM_HOST, KVEventRecorder
from conveyor.kv.layout import KVLayout
from conveyor.request import Request

# Prefix-cache keys: block i's key is sha256(key of block i-1, or ROOT_HASH for the first block ||
# content_i), content_i = u32 length of the extra keys || the extra keys || the block's token ids
# as int32, little-endian. Only the first block has extra keys (the cache salt), so everything
# chains from them. The pool also compares content and parent on every hit (block_pool.py).
ROOT_HASH = bytes(32)
assert array("i").itemsize == 4
_BIG_ENDIAN = sys.byteorder == "big"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def extra_keys(request: Request) -> bytes:
    """What besides its tokens changes a sequence's KV, as tagged, length-prefixed fields that go
    into its first block's key. Anything else that would (adapters, multimodal inputs) joins here."""
    if request.cache_salt is None:
        return b""
    salt = request.cache_salt.encode("utf-8", "surrogatepass")
    return b"s" + len(salt).to_bytes(4, "little") + salt


def block_content(tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """A block's bytes as its key covers them (without the parent): extra keys, then token ids."""
    ids = array("i", tokens)
    if _BIG_ENDIAN:
        ids.byteswap()
    return len(extra).to_bytes(4, "little") + extra + ids.tobytes()


def chain_hash(parent: bytes | None, content: bytes) -> bytes:
    """A full block's prefix-cache key: sha256 over the parent block's key and its content."""
    return hashlib.sha256((ROOT_HASH if parent is None else parent) + content).digest()


class CachedPrefix(list):
    """A prefix-cache hit: the block ids of `num_blocks` leading blocks of the request's tokens in
    every group, interleaved like a table (with one group: just the blocks), the null block where a
    local group needs none."""

    __slots__ = ("num_blocks", "pages", "group_hits")

    def __init__(self, ids=(), num_blocks: int | None = None, pages: int | None = None,
                 group_hits: list[int] | None = None):
        super().__init__(ids)
        self.num_blocks = len(self) if num_blocks is None else num_blocks   # the hit is num_blocks * block_size tokens
        self.pages = len(self) if pages is None else pages                  # pool blocks among the ids (not null)
        self.group_hits = group_hits or []   # per group: blocks it alone could have supplied

    def block_ids(self) -> set[int]:
        return set(self)


NO_PREFIX = CachedPrefix()


def _hit(cached) -> CachedPrefix:
    """A plain list of block ids (one group) as a hit."""
    return cached if isinstance(cached, CachedPrefix) else CachedPrefix(cached)


@dataclass(slots=True)
class BlockKeys:
    """A request's full blocks' keys and contents, computed incrementally (O(new blocks) a step)."""

    hashes: list[bytes] = field(default_factory=list)
    contents: list[bytes] = field(default_factory=list)


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
        self.num_null: dict[str, int] = {}           # request id -> null entries in its table
        self.group_hits = [0] * layout.num_groups    # per group: blocks it alone could have supplied
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.host = HostPool(num_host_blocks)
        self.tables: dict[str, list[int]] = {}       # request id -> device block ids
        self.host_tables: dict[str, list[int]] = {}  # request id -> host block ids (while swapped)
        # While swapped: the request's table with None where a block went to the host; the
        # blocks it shares with others stay on the device (copying them would free nothing).
        self.swapped_tables: dict[str, list[int | None]] = {}
        self.hashes: dict[str, BlockKeys] = {}       # request id -> keys (chained sha256) of its full blocks
        self.num_registered: dict[str, int] = {}     # request id -> leading blocks published in the cache
        # request id -> the publication its next full block is computed after (0: none yet);
        # None: a block of its chain could not be published (collision), so no later one is.
        self.chain_parent: dict[str, list[int | None]] = {}   # per group (global groups; local ones: 0)
        # KV events (conveyor/kv/events.py): None unless enabled, and then every hook below is skipped.
        self.events: KVEventRecorder | None = None
        self.host_keys: dict[str, list[bytes]] = {}   # request id -> keys of its published blocks on the host

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
        G, bs = self.num_groups, self.block_size
        dropped = sum(self.layout.dropped(w, num_computed, bs) for w in self.windows)
        return max(1, (self.num_blocks + dropped) // G * bs - num_computed)

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
        return len(self.host_tables.get(request_id, ()))

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

    def _block_keys(self, request: Request, upto_tokens: int) -> BlockKeys:
        """Keys and contents of the request's full blocks within (at least) its first upto_tokens tokens."""
        keys = self.hashes.get(request.request_id)
        if keys is None:
            keys = self.hashes[request.request_id] = BlockKeys()
        hashes, contents = keys.hashes, keys.contents
        bs, toks = self.block_size, request.all_token_ids
        for i in range(len(hashes), upto_tokens // bs):
            content = block_content(toks[i * bs:(i + 1) * bs], b"" if i else extra_keys(request))
            hashes.append(chain_hash(hashes[-1] if hashes else None, content))
            contents.append(content)
        return keys

    def reads_prefix_cache(self, request: Request) -> bool:
        """Prompt logprobs and mean pooling need every prompt token computed, not cached."""
        p = request.params
        return self.pool.enable_caching and p.prompt_logprobs is None and p.pooling != "mean"

    def _key(self, keys: BlockKeys, i: int, group: int) -> tuple[bytes, bytes]:
        """Group `group`'s cache key and verified content for the request's block i. Group 0 uses
        the plain key; other groups tag it. A local group keeps no blocks before its window, so it
        cannot verify a block's parent publication: its content carries the parent's key instead."""
        key = keys.hashes[i] if group == 0 else keys.hashes[i] + bytes((group,))
        if not self.windows[group]:
            return key, keys.contents[i]
        return key, (keys.hashes[i - 1] if i else ROOT_HASH) + keys.contents[i]

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """Cached blocks matching the longest prefix of the request's tokens, in every group: a
        global group needs all blocks of the prefix, a local group only those its window sees
        from the prefix's end.

        At least one token is always left to compute (its logits are needed), so a fully
        cached sequence gives up its last full block.
        """
        if not self.reads_prefix_cache(request):
            return NO_PREFIX
        n = (request.num_tokens - 1) // self.block_size
        keys = self._block_keys(request, n * self.block_size)
        pool, G, bs = self.pool, self.num_groups, self.block_size
        hits, chains, limit = [0] * G, {}, n
        for g, w in enumerate(self.windows):
            if w:
                continue
            found, parent = [], 0
            for i in range(n):
                # Verified hit: same content (tokens, salt) computed after the block matched just before.
                block_id = pool.match(*self._key(keys, i, g), parent)
                if block_id is None:
                    break
                found.append(block_id)
                parent = pool.blocks[block_id].pub_id
            chains[g], hits[g] = found, len(found)
            limit = min(limit, len(found))
        local: dict[tuple[int, int], int | None] = {}

        def present(g: int, i: int) -> int | None:
            if (g, i) not in local:
                key, content = self._key(keys, i, g)
                local[g, i] = pool.match(key, content, 0)
            return local[g, i]

        def fits(g: int, m: int) -> int:
            """The largest prefix <= m blocks whose window blocks group g holds."""
            while m > 0:
                lo = self.layout.dropped(self.windows[g], m * bs, bs)
                miss = next((j for j in range(m - 1, lo - 1, -1) if present(g, j) is None), None)
                if miss is None:
                    return m
                m = miss   # every prefix longer than the miss still sees it
            return 0

        for g, w in enumerate(self.windows):
            if w:
                hits[g] = fits(g, n)
        m = limit
        while True:   # shrink until every local group holds its window at the prefix's end
            m2 = m
            for g, w in enumerate(self.windows):
                if w:
                    m2 = fits(g, m2)
            if m2 == m:
                break
            m = m2
        if m == 0:
            return CachedPrefix((), 0, 0, hits)
        ids, null = [], self.null_block
        drop = [self.layout.dropped(w, m * bs, bs) for w in self.windows]
        for b in range(m):
            for g, w in enumerate(self.windows):
                ids.append(chains[g][b] if not w else null if b < drop[g] else local[g, b])
        return CachedPrefix(ids, m, sum(1 for b in ids if b != null), hits)

    def record_prefix_lookup(self, request: Request, cached: CachedPrefix) -> None:
        """Count one admission's lookup (done once, not on every deferred retry)."""
        self.pool.stats.prefix_queries += (request.num_tokens - 1) // self.block_size
        self.pool.stats.prefix_hits += cached.num_blocks
        for g, h in enumerate(cached.group_hits):
            self.group_hits[g] += h

    # ---- allocation ----------------------------------------------------------------------
    def blocks_needed(self, request: Request, num_new_tokens: int, cached: CachedPrefix = NO_PREFIX) -> int:
        """Pool blocks that growing the request's tables to num_computed + num_new_tokens takes."""
        have = len(self.tables.get(request.request_id, ())) // self.num_groups + _hit(cached).num_blocks
        want = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, want - have) * self.num_groups

    def can_allocate(self, n: int, cached: CachedPrefix = NO_PREFIX) -> bool:
        # Cached hits that sit in the free queue are taken out of it when touched.
        return n + self.num_revived(cached) <= self.pool.num_free

    def allocate(self, request: Request, num_new_tokens: int, cached: CachedPrefix = NO_PREFIX) -> bool:
        """Grow the request's tables to hold num_computed + num_new_tokens. All or nothing."""
        cached = _hit(cached)
        need = self.blocks_needed(request, num_new_tokens, cached)
        if not self.can_allocate(need, cached):
            return False
        rid = request.request_id
        table = self.tables.setdefault(rid, [])
        if cached.num_blocks:
            null = self.null_block
            for block_id in cached:
                if block_id != null:
                    self.pool.touch(block_id)
            table.extend(cached)
            self.num_null[rid] = len(cached) - cached.pages
            self.num_registered[rid] = cached.num_blocks
            last = cached[-self.num_groups:]
            self.chain_parent[rid] = [0 if w else self.pool.blocks[b].pub_id for b, w in zip(last, self.windows)]
        table.extend(self.pool.allocate(need))
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
        G, bs, null = self.num_groups, self.block_size, self.null_block
        logical = len(table) // G
        freed = 0
        for g, w in enumerate(self.windows):
            if not w:
                continue
            # A group's given-back blocks are a leading run of nulls: walk back from the window's
            # start to that run (O(blocks given back now)), then give them back oldest first.
            b = min(self.layout.dropped(w, request.num_computed_tokens, bs), logical)
            going = []
            while b > 0 and table[(b - 1) * G + g] != null:
                b -= 1
                going.append(b * G + g)
            for i in reversed(going):
                self.pool.release([table[i]])
                table[i] = null
            freed += len(going)
        if freed:
            self.num_null[rid] = self.num_null.get(rid, 0) + freed

    def publish_full_blocks(self, request: Request) -> None:
        """Put the request's newly completed blocks into the prefix cache (every group's)."""
        if not self.pool.enable_caching:
            return
        rid = request.request_id
        table = self.tables.get(rid)
        if not table:
            return
        G = self.num_groups
        full = min(request.num_computed_tokens // self.block_size, len(table) // G)
        start = self.num_registered.get(rid, 0)
        if full <= start:
            return
        keys = self._block_keys(request, full * self.block_size)
        parents = self.chain_parent.get(rid) if start else None
        parents = list(parents) if parents is not None else [0] * G
        events, cached, null = self.events, self.pool.cached, self.null_block
        run = end = start   # events: the newly published blocks run..end-1 are not reported yet
        for i in range(start, full):
            for g, w in enumerate(self.windows):
                block_id = table[i * G + g]
                if g == 0 and block_id == null and events is not None:   # given back: not stored anew
                    self._report_stored(request, keys.hashes, run, i)
                    run = end = i + 1
                if (parents[g] is None and not w) or block_id == null:
                    continue
                key, content = self._key(keys, i, g)
                was = cached.get(key) if events is not None and g == 0 else None
                holder = self.pool.register(block_id, key, content, 0 if w else parents[g])
                if not w:
                    parents[g] = None if holder is None else self.pool.blocks[holder].pub_id
                if g == 0:
                    if parents[0] is None and not w:
                        continue
                    end = i + 1
                    if events is not None and (holder != block_id or was == holder):   # not newly published here
                        self._report_stored(request, keys.hashes, run, i)
                        run = end
        if events is not None:
            self._report_stored(request, keys.hashes, run, end)
        self.chain_parent[rid] = parents
        self.num_registered[rid] = full

    def _report_stored(self, request: Request, hashes: list[bytes], start: int, end: int,
                       medium: str = MEDIUM_DEVICE) -> None:
        """Events: the request's blocks start..end-1 (consecutive) entered the cache (or the host)."""
        if end <= start:
            return
        bs = self.block_size
        tokens = request.all_token_ids[start * bs:end * bs]
        parent = hashes[start - 1] if start else None
        salt = request.cache_salt if start == 0 else None
        self.events.stored(hashes[start:end], parent, tokens, salt, medium)

    def free(self, request: Request) -> None:
        rid = request.request_id
        table = self.tables.pop(rid, None)
        if table:
            null = self.null_block
            self.pool.release([b for b in table[::-1] if b != null])
        host = self.host_tables.pop(rid, None)
        if host:
            self.host.release(host)
        if self.events is not None and rid in self.host_keys:
            self.events.removed(self.host_keys.pop(rid), MEDIUM_HOST)
        pinned = self.swapped_tables.pop(rid, None)
        if pinned:
            self.pool.release([b for b in pinned[::-1] if b is not None and b != self.null_block])
        self.num_registered.pop(rid, None)
        self.chain_parent.pop(rid, None)
        self.num_null.pop(rid, None)

    def forget(self, request: Request) -> None:
        """Drop a finished request's cached block keys."""
        self.hashes.pop(request.request_id, None)

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

    def num_shared_prefix_tokens(self, request: Request) -> int:
        """Tokens of the request's leading blocks that others hold too: they stay cached when it
        is preempted, so recomputing it starts after them (a prefix-cache hit)."""
        if not self.reads_prefix_cache(request):
            return 0
        if all(self.windows):   # what a local group gave back decides: assume nothing stays
            return 0
        # Layer groups: the global groups' blocks (a local group's at the hit's end may have been
        # given back; then more is recomputed than this says).
        table, G, blocks = self.tables.get(request.request_id, ()), self.num_groups, self.pool.blocks
        full = [g for g, w in enumerate(self.windows) if not w]
        n = 0
        for i in range(0, len(table), G):
            if any(blocks[table[i + g]].ref_count < 2 or blocks[table[i + g]].block_hash is None for g in full):
                break
            n += 1
        return min(n * self.block_size, max(0, request.num_tokens - 1))

    def num_pinned(self, request_id: str) -> int:
        """Device blocks a swapped-out request still holds (shared with others)."""
        return sum(1 for b in self.swapped_tables.get(request_id, ()) if b is not None and b != self.null_block)

    def can_swap_out(self, request: Request) -> bool:
        return self.num_unshared(request.request_id) <= self.host.num_free

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's unshared KV to host blocks; returns (device block, host block) copies.
        Shared blocks stay on the device, held by the swapped request."""
        rid = request.request_id
        table = self.tables.pop(rid)
        blocks, null = self.pool.blocks, self.null_block
        moved = [b for b in table if b != null and blocks[b].ref_count == 1]
        if self.events is not None:
            self._report_swapped_out(request, table)
        host = self.host.allocate(len(moved))
        self.host_tables[rid] = host
        self.swapped_tables[rid] = [None if b != null and blocks[b].ref_count == 1 else b for b in table]
        self.pool.release(moved[::-1])
        self.num_registered.pop(rid, None)
        return list(zip(moved, host))

    def can_swap_in(self, request: Request) -> bool:
        return len(self.host_tables[request.request_id]) <= self.pool.num_free

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring the request's KV back; returns (host block, device block) copies."""
        rid = request.request_id
        host = self.host_tables.pop(rid)
        fresh = iter(self.pool.allocate(len(host)))
        new = []
        table = []
        for b in self.swapped_tables.pop(rid):
            if b is None:
                b = next(fresh)
                new.append(b)
            table.append(b)
        self.tables[rid] = table
        self.host.release_after_step(host)
        if self.events is not None and rid in self.host_keys:
            self.events.removed(self.host_keys.pop(rid), MEDIUM_HOST)
        return list(zip(host, new))

    def _report_swapped_out(self, request: Request, table: list[int]) -> None:
        """Events: the request's published blocks that swap-out copies to the host (its unshared ones)."""
        blocks, keys = self.pool.blocks, self.hashes.get(request.request_id)
        hashes = keys.hashes if keys is not None else []
        on_host, run = [], None
        for i, b in enumerate(table[::self.num_groups] + [None]):   # group 0's blocks
            moved = (b is not None and b != self.null_block and i < len(hashes) and blocks[b].ref_count == 1
                     and blocks[b].block_hash == hashes[i])
            if moved:
                on_host.append(hashes[i])
                run = i if run is None else run
            elif run is not None:
                self._report_stored(request, hashes, run, i, MEDIUM_HOST)
                run = None
        if on_host:
            self.host_keys[request.request_id] = on_host

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix that no request holds; True if nothing is cached any more
        (then the events say AllBlocksCleared, else which blocks left)."""
        self.pool.reset_prefix_cache()
        empty = not self.pool.cached
        if self.events is not None and empty and not self.host_keys:
            self.events.pending.clear()   # whatever this step stored or removed is gone now
            self.events.cleared()
        return empty

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
        host_used = sum(len(t) for t in self.host_tables.values())
        assert host_used + self.host.num_free + len(self.host.quarantine) == self.host.num_blocks
        assert set(self.swapped_tables) == set(self.host_tables)
        for rid, table in self.swapped_tables.items():
            assert table.count(None) == len(self.host_tables[rid])
        if live_ids is not None:
            assert set(self.tables) | set(self.host_tables) <= live_ids
