"""The prefix-cache index over the block pool: lookups, publication, hit accounting.

The pool (block_pool.py) maps a key to the block holding it and verifies content and parent on
every hit; this module keeps each request's block keys (block_keys.py), finds which cached blocks
a new request may reuse (per layer group, through that group's attention-kind manager,
attention_kinds.py) and publishes its newly computed blocks.
"""

from __future__ import annotations

from collections.abc import Callable

from conveyor.kv.attention_kinds import GroupManager, PrefixLookup
from conveyor.kv.block_keys import BlockKeys
from conveyor.kv.block_pool import BlockPool
from conveyor.kv.events import MEDIUM_DEVICE, KVEventRecorder
from conveyor.request import Request


class CachedPrefix(list):
    """A prefix-cache hit: the block ids of `num_blocks` leading blocks of the request's tokens in
    every group, interleaved like a table (with one group: just the blocks), the null block where a
    local group needs none."""

    __slots__ = ("num_blocks", "pages", "group_hits", "prompt_logprobs")

    def __init__(self, ids=(), num_blocks: int | None = None, pages: int | None = None,
                 group_hits: list[int] | None = None, prompt_logprobs: list | None = None):
        super().__init__(ids)
        self.num_blocks = len(self) if num_blocks is None else num_blocks   # the hit is num_blocks * block_size tokens
        self.pages = len(self) if pages is None else pages                  # pool blocks among the ids (not null)
        self.group_hits = group_hits or []   # per group: blocks it alone could have supplied
        # a prompt-logprob request's entries known from the cached blocks (its list from the start)
        self.prompt_logprobs = prompt_logprobs

    def block_ids(self) -> set[int]:
        return set(self)


NO_PREFIX = CachedPrefix()


def as_hit(cached) -> CachedPrefix:
    """A plain list of block ids (one group) as a hit."""
    return cached if isinstance(cached, CachedPrefix) else CachedPrefix(cached)


def report_stored(events: KVEventRecorder, request: Request, hashes: list[bytes], start: int, end: int,
                  block_size: int, medium: str = MEDIUM_DEVICE) -> None:
    """Events: the request's blocks start..end-1 (consecutive) entered the cache (or the host)."""
    if end <= start:
        return
    tokens = request.all_token_ids[start * block_size:end * block_size]
    parent = hashes[start - 1] if start else None
    salt = request.cache_salt if start == 0 else None
    events.stored(hashes[start:end], parent, tokens, salt, medium, request.lora, start == 0)


class _StoredRuns:
    """Events for one publication: group 0's newly published blocks, reported in runs of
    consecutive blocks (a run ends at a block that is not stored anew)."""

    __slots__ = ("report", "run", "end")

    def __init__(self, report: Callable[[int, int], None], start: int):
        self.report = report
        self.run = self.end = start   # blocks run..end-1 are published and not reported yet

    def gap(self, i: int) -> None:
        """Block i is not stored anew (given back, or already published): report the run before it."""
        self.report(self.run, i)
        self.run = self.end = i + 1

    def published(self, i: int, fresh: bool) -> None:
        if fresh:
            self.end = i + 1
        else:
            self.gap(i)

    def close(self) -> None:
        self.report(self.run, self.end)


class PrefixCache:
    """Per request: its block keys, how many leading blocks it published, and where its chains of
    publications stand; for the cache: lookups and the per-group hit counts."""

    def __init__(self, pool: BlockPool, kinds: list[GroupManager], block_size: int, null_block: int):
        self.pool = pool
        self.kinds = kinds                           # per layer group: its attention kind's manager
        self.block_size = block_size
        self.null_block = null_block
        self.hashes: dict[str, BlockKeys] = {}       # request id -> keys (chained sha256) of its full blocks
        self.num_registered: dict[str, int] = {}     # request id -> leading blocks published in the cache
        # request id -> the publication its next full block is computed after (0: none yet);
        # None: a block of its chain could not be published (collision), so no later one is.
        self.chain_parent: dict[str, list[int | None]] = {}   # per group (global groups; local ones: 0)
        self.group_hits = [0] * len(kinds)           # per group: blocks it alone could have supplied

    def reads(self, request: Request) -> bool:
        """Whether any of the request's tokens may come from the cache (Request.cacheable_prefix, or
        cached blocks that keep the prompt logprobs it wants)."""
        return self.pool.enable_caching and (request.cacheable_prefix != 0 or self._keeps_logprobs(request))

    def _keeps_logprobs(self, request: Request) -> bool:
        """Prompt logprobs still wanted, read from (and kept with) cached blocks: one layer group only
        (a sliding-window group's blocks are not all kept)."""
        return len(self.kinds) == 1 and request.params.pooling != "mean" and request.prompt_logprobs_pending

    def block_keys(self, request: Request, upto_tokens: int) -> BlockKeys:
        """Keys and contents of the request's full blocks within (at least) its first upto_tokens tokens."""
        keys = self.hashes.get(request.request_id)
        if keys is None:
            keys = self.hashes[request.request_id] = BlockKeys()
        return keys.extend(request, upto_tokens, self.block_size)

    # ---- lookup --------------------------------------------------------------------------
    def find(self, request: Request) -> CachedPrefix:
        """Cached blocks matching the longest prefix of the request's tokens, in every group: a
        global group needs all blocks of the prefix, a local group only those its window sees
        from the prefix's end.

        At least one token is always left to compute (its logits are needed), so a fully
        cached sequence gives up its last full block.
        """
        if not self.reads(request):
            return NO_PREFIX
        n = (request.num_tokens - 1) // self.block_size
        kept = self._keeps_logprobs(request)
        if request.cacheable_prefix is not None and not kept:
            n = min(n, request.cacheable_prefix // self.block_size)
        keys = self.block_keys(request, n * self.block_size)
        lookups = [kind.lookup(self.pool, keys, n) for kind in self.kinds]
        hits = [lookup.hits for lookup in lookups]
        m = self._common_prefix(lookups, n)
        known = None
        if kept and m:
            m, known = self._logprob_hit(request, lookups[0].blocks(m))
        if m == 0:
            return CachedPrefix((), 0, 0, hits, known)
        columns = [lookup.blocks(m) for lookup in lookups]
        ids = [column[b] for b in range(m) for column in columns]
        return CachedPrefix(ids, m, sum(1 for b in ids if b != self.null_block), hits, known)

    def _logprob_hit(self, request: Request, blocks: list[int]) -> tuple[int, list]:
        """A prompt-logprob request's hit among these cached leading blocks, and its list of entries
        from them. Every wanted logprob needs the logits of the position before it, so the hit ends
        before the first entry no block keeps (a block computed by a request that asked for the same
        top-k keeps its tokens' entries)."""
        bs, total, wanted = self.block_size, request.num_prompt_tokens, request.prompt_logprobs_from
        k, kept = request.params.prompt_logprobs, []
        for i, block_id in enumerate(blocks):
            if (i + 1) * bs > total:
                break
            record = self.pool.blocks[block_id].logprobs
            if (i + 1) * bs <= wanted:   # none of its tokens' logprobs is wanted
                kept.append(None)
            elif record is not None and record[0] == k:
                kept.append(record[1])
            else:
                break
        known = min(total, max(len(kept) * bs, wanted))   # entries known: for the tokens before this one
        entries = [None] * min(wanted, known)
        entries += [kept[t // bs][t % bs] for t in range(len(entries), known)]
        return (len(blocks) if known == total else min(len(blocks), (known - 1) // bs)), entries

    @staticmethod
    def _common_prefix(lookups: list[PrefixLookup], n: int) -> int:
        """The longest prefix (<= n blocks) that every group can supply: start from the groups'
        fixed bounds, then shrink until every group holds what it needs at the prefix's end. (Which
        blocks a sliding window probes follows this order, and the pool counts mismatched probes.)"""
        m = min([n, *(lookup.bound for lookup in lookups)])
        while True:
            m2 = m
            for lookup in lookups:
                m2 = lookup.fits(m2)
            if m2 == m:
                return m
            m = m2

    def record_lookup(self, request: Request, cached: CachedPrefix) -> None:
        """Count one admission's lookup (done once, not on every deferred retry)."""
        self.pool.stats.prefix_queries += (request.num_tokens - 1) // self.block_size
        self.pool.stats.prefix_hits += cached.num_blocks
        for g, h in enumerate(cached.group_hits):
            self.group_hits[g] += h

    def adopt(self, request_id: str, cached: CachedPrefix) -> None:
        """The request's table starts with the hit: its blocks count as published, and its chains
        go on after the hit's last block in every group."""
        self.num_registered[request_id] = cached.num_blocks
        last = cached[-len(self.kinds):]
        self.chain_parent[request_id] = [kind.parent_after(self.pool, b) for b, kind in zip(last, self.kinds)]

    # ---- publication ---------------------------------------------------------------------
    def publish(self, request: Request, table: list[int], events: KVEventRecorder | None) -> None:
        """Put the request's newly completed blocks into the prefix cache (every group's)."""
        rid, G = request.request_id, len(self.kinds)
        full = min(request.num_computed_tokens // self.block_size, len(table) // G)
        start = self.num_registered.get(rid, 0)
        if full <= start:
            return
        keys = self.block_keys(request, full * self.block_size)
        parents = self.chain_parent.get(rid) if start else None
        parents = list(parents) if parents is not None else [0] * G
        stored = None
        if events is not None:
            stored = _StoredRuns(lambda a, b: report_stored(events, request, keys.hashes, a, b, self.block_size),
                                 start)
        pool, null = self.pool, self.null_block
        for i in range(start, full):
            for g, kind in enumerate(self.kinds):
                block_id = table[i * G + g]
                if block_id == null:   # given back: not stored anew
                    if g == 0 and stored is not None:
                        stored.gap(i)
                    continue
                if not kind.can_publish(parents[g]):
                    continue
                key, content = kind.key(keys, i)
                was = pool.lookup(key) if g == 0 and stored is not None else None
                holder, parents[g] = kind.publish(pool, block_id, key, content, parents[g])
                if holder is not None and request.prompt_logprobs is not None and G == 1:
                    self._keep_logprobs(request, i, holder)
                if g == 0 and stored is not None and parents[0] is not None:
                    stored.published(i, fresh=holder == block_id and was != holder)
        if stored is not None:
            stored.close()
        self.chain_parent[rid] = parents
        self.num_registered[rid] = full

    def _keep_logprobs(self, request: Request, i: int, holder: int) -> None:
        """Keep with cached block `holder` the prompt logprobs of the tokens of the request's block i,
        when the request has them all (a later request asking for the same top-k reads them)."""
        start, end = i * self.block_size, (i + 1) * self.block_size
        entries = request.prompt_logprobs
        block = self.pool.blocks[holder]
        if block.logprobs is None and len(entries) >= end and all(e is not None for e in entries[max(1, start):end]):
            block.logprobs = (request.params.prompt_logprobs, entries[start:end])

    def unpublished(self, request_id: str) -> None:
        """The request's table is gone (freed or swapped out): nothing of it counts as published."""
        self.num_registered.pop(request_id, None)

    def drop(self, request_id: str) -> None:
        self.num_registered.pop(request_id, None)
        self.chain_parent.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's cached block keys."""
        self.hashes.pop(request_id, None)
