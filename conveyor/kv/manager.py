"""Per-request block tables on top of the device block pool, prefix-cache lookups, and swap.

The manager hands out block ids only; the executor owns the tensors and applies the copy
mappings that swap-out/swap-in return.
"""

from __future__ import annotations

from conveyor.kv.block_pool import BlockPool, PoolStats
from conveyor.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    # Anything else that changes a block's KV (adapters, multimodal inputs) would join the key.
    return hash((parent, tokens))


class HostPool:
    """Host-memory blocks that receive swapped-out KV. No caching, O(1) alloc/free."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_ids = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self.free_ids)
        return [self.free_ids.pop() for _ in range(n)]

    def release(self, ids: list[int]) -> None:
        self.free_ids.extend(ids)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.host = HostPool(num_host_blocks)
        self.tables: dict[str, list[int]] = {}       # request id -> device block ids
        self.host_tables: dict[str, list[int]] = {}  # request id -> host block ids (while swapped)
        self.hashes: dict[str, list[int]] = {}       # request id -> chained hashes of its full blocks
        self.num_registered: dict[str, int] = {}     # request id -> leading blocks published in the cache

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

    def _block_hashes(self, request: Request, upto_tokens: int) -> list[int]:
        """Chained hashes of the request's full blocks within its first upto_tokens tokens."""
        hashes = self.hashes.setdefault(request.request_id, [])
        bs, toks = self.block_size, request.all_token_ids
        for i in range(len(hashes), upto_tokens // bs):
            hashes.append(chain_hash(hashes[-1] if hashes else None, tuple(toks[i * bs:(i + 1) * bs])))
        return hashes

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks matching the longest prefix of the request's tokens.

        At least one token is always left to compute (its logits are needed), so a fully
        cached sequence gives up its last full block.
        """
        p = request.params
        if not self.pool.enable_caching or p.prompt_logprobs is not None or p.pooling == "mean":
            return []   # prompt logprobs and mean pooling need every prompt token computed, not cached
        hashes = self._block_hashes(request, request.num_tokens - 1)
        found = []
        for h in hashes:
            block_id = self.pool.lookup(h)
            if block_id is None:
                break
            found.append(block_id)
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
        hashes = self._block_hashes(request, full * self.block_size)
        for i in range(start, full):
            self.pool.register(table[i], hashes[i])
        self.num_registered[rid] = full

    def free(self, request: Request) -> None:
        rid = request.request_id
        table = self.tables.pop(rid, None)
        if table:
            self.pool.release(table[::-1])
        host = self.host_tables.pop(rid, None)
        if host:
            self.host.release(host)
        self.num_registered.pop(rid, None)

    def forget(self, request: Request) -> None:
        """Drop a finished request's cached block hashes."""
        self.hashes.pop(request.request_id, None)

    # ---- swap ----------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        return self.num_held(request.request_id) <= self.host.num_free

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's KV to host blocks; returns (device block, host block) copies."""
        rid = request.request_id
        table = self.tables.pop(rid)
        host = self.host.allocate(len(table))
        self.host_tables[rid] = host
        self.pool.release(table[::-1])
        self.num_registered.pop(rid, None)
        return list(zip(table, host))

    def can_swap_in(self, request: Request) -> bool:
        return len(self.host_tables[request.request_id]) <= self.pool.num_free

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring the request's KV back; returns (host block, device block) copies."""
        rid = request.request_id
        host = self.host_tables.pop(rid)
        table = self.pool.allocate(len(host))
        self.tables[rid] = table
        self.host.release(host)
        return list(zip(host, table))

    def check_invariants(self, live_ids: set[str] | None = None) -> None:
        self.pool.check_invariants()
        owners: dict[int, int] = {}
        for table in self.tables.values():
            for b in table:
                owners[b] = owners.get(b, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_count == owners.get(block.block_id, 0), \
                f"block {block.block_id}: ref {block.ref_count} != owners {owners.get(block.block_id, 0)}"
        host_used = sum(len(t) for t in self.host_tables.values())
        assert host_used + self.host.num_free == self.host.num_blocks
        if live_ids is not None:
            assert set(self.tables) | set(self.host_tables) <= live_ids
