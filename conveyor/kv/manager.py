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
    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True):
        self.block_size = block_size
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
        self.chain_parent: dict[str, int | None] = {}
        # KV events (conveyor/kv/events.py): None unless enabled, and then every hook below is skipped.
        self.events: KVEventRecorder | None = None
        self.host_keys: dict[str, list[bytes]] = {}   # request id -> keys of its published blocks on the host

    def enable_events(self, recorder: KVEventRecorder) -> None:
        """Report blocks entering and leaving the prefix cache (and host memory) to `recorder`."""
        self.events = recorder
        self.pool.on_remove = lambda key: recorder.removed((key,))

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

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def num_held(self, request_id: str) -> int:
        return len(self.tables.get(request_id, ()))

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

    def num_revived(self, cached: list[int]) -> int:
        """Prefix-cache hits that sit in the free queue: taking them uses up free blocks."""
        return sum(1 for b in cached if self.pool.blocks[b].ref_count == 0)

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

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks matching the longest prefix of the request's tokens.

        At least one token is always left to compute (its logits are needed), so a fully
        cached sequence gives up its last full block.
        """
        if not self.reads_prefix_cache(request):
            return []
        n = (request.num_tokens - 1) // self.block_size
        keys = self._block_keys(request, n * self.block_size)
        pool, found, parent = self.pool, [], 0
        for i in range(n):
            # Verified hit: same content (tokens, salt) computed after the block matched just before.
            block_id = pool.match(keys.hashes[i], keys.contents[i], parent)
            if block_id is None:
                break
            found.append(block_id)
            parent = pool.blocks[block_id].pub_id
        return found

    def record_prefix_lookup(self, request: Request, num_hits: int) -> None:
        """Count one admission's lookup (done once, not on every deferred retry)."""
        self.pool.stats.prefix_queries += (request.num_tokens - 1) // self.block_size
        self.pool.stats.prefix_hits += num_hits

    # ---- allocation ----------------------------------------------------------------------
    def blocks_needed(self, request: Request, num_new_tokens: int, num_cached_blocks: int = 0) -> int:
        have = self.num_held(request.request_id) + num_cached_blocks
        return max(0, self.blocks_for(request.num_computed_tokens + num_new_tokens) - have)

    def can_allocate(self, n: int, cached: list[int] = ()) -> bool:
        # Cached hits that sit in the free queue are taken out of it when touched.
        return n + self.num_revived(cached) <= self.pool.num_free

    def allocate(self, request: Request, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Grow the request's table to hold num_computed + num_new_tokens. All or nothing."""
        need = self.blocks_needed(request, num_new_tokens, len(cached))
        if not self.can_allocate(need, cached):
            return False
        table = self.tables.setdefault(request.request_id, [])
        for block_id in cached:
            self.pool.touch(block_id)
        table.extend(cached)
        if cached:
            self.num_registered[request.request_id] = len(table)
            self.chain_parent[request.request_id] = self.pool.blocks[cached[-1]].pub_id
        table.extend(self.pool.allocate(need))
        return True

    def publish_full_blocks(self, request: Request) -> None:
        """Put the request's newly completed blocks into the prefix cache."""
        if not self.pool.enable_caching:
            return
        rid = request.request_id
        table = self.tables.get(rid)
        if not table:
            return
        full = min(request.num_computed_tokens // self.block_size, len(table))
        start = self.num_registered.get(rid, 0)
        if full <= start:
            return
        keys = self._block_keys(request, full * self.block_size)
        parent = self.chain_parent.get(rid) if start else 0
        events, cached = self.events, self.pool.cached
        run = end = start   # events: the newly published blocks run..end-1 are not reported yet
        for i in range(start, full):
            if parent is None:
                break
            was = cached.get(keys.hashes[i]) if events is not None else None
            holder = self.pool.register(table[i], keys.hashes[i], keys.contents[i], parent)
            parent = None if holder is None else self.pool.blocks[holder].pub_id
            end = i + 1
            if events is not None and (holder != table[i] or was == holder):   # not newly published here
                self._report_stored(request, keys.hashes, run, i)
                run = end
        if events is not None:
            self._report_stored(request, keys.hashes, run, end)
        self.chain_parent[rid] = parent
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
            self.pool.release(table[::-1])
        host = self.host_tables.pop(rid, None)
        if host:
            self.host.release(host)
        if self.events is not None and rid in self.host_keys:
            self.events.removed(self.host_keys.pop(rid), MEDIUM_HOST)
        pinned = self.swapped_tables.pop(rid, None)
        if pinned:
            self.pool.release([b for b in pinned[::-1] if b is not None])
        self.num_registered.pop(rid, None)
        self.chain_parent.pop(rid, None)

    def forget(self, request: Request) -> None:
        """Drop a finished request's cached block keys."""
        self.hashes.pop(request.request_id, None)

    # ---- swap ----------------------------------------------------------------------------
    def num_unshared(self, request_id: str) -> int:
        """Blocks that only this request holds: what preempting it (either way) frees."""
        blocks = self.pool.blocks
        return sum(1 for b in self.tables.get(request_id, ()) if blocks[b].ref_count == 1)

    def blocks_freed_by(self, requests: list[Request], swaps: Callable[[Request], bool],
                        keep: set[int] | frozenset = frozenset()) -> list[int]:
        """For running requests preempted in this order: the blocks each one's preemption frees.
        Recompute drops all its blocks, so a block shared only among them is freed by the last of
        them to go; swap (if `swaps(request)` and the host pool still has room for what it would
        copy) frees only the blocks nobody else holds at that moment and keeps the shared ones.
        Blocks in `keep` are not counted."""
        dropped: dict[int, int] = {}
        blocks = self.pool.blocks
        host_free = self.host.num_free
        out = []
        for r in requests:
            table = self.tables.get(r.request_id, ())
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
        n = 0
        for b in self.tables.get(request.request_id, ()):
            block = self.pool.blocks[b]
            if block.ref_count < 2 or block.block_hash is None:
                break
            n += 1
        return min(n * self.block_size, max(0, request.num_tokens - 1))

    def num_pinned(self, request_id: str) -> int:
        """Device blocks a swapped-out request still holds (shared with others)."""
        return sum(1 for b in self.swapped_tables.get(request_id, ()) if b is not None)

    def can_swap_out(self, request: Request) -> bool:
        return self.num_unshared(request.request_id) <= self.host.num_free

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's unshared KV to host blocks; returns (device block, host block) copies.
        Shared blocks stay on the device, held by the swapped request."""
        rid = request.request_id
        table = self.tables.pop(rid)
        blocks = self.pool.blocks
        moved = [b for b in table if blocks[b].ref_count == 1]
        if self.events is not None:
            self._report_swapped_out(request, table)
        host = self.host.allocate(len(moved))
        self.host_tables[rid] = host
        self.swapped_tables[rid] = [None if blocks[b].ref_count == 1 else b for b in table]
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
        for i, b in enumerate(table + [None]):
            moved = (b is not None and i < len(hashes) and blocks[b].ref_count == 1
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
        for table in [*self.tables.values(), *self.swapped_tables.values()]:
            for b in table:
                if b is not None:
                    owners[b] = owners.get(b, 0) + 1
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
