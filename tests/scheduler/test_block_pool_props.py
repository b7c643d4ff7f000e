"""Property tests of BlockPool and KVCacheManager: ownership, ref counts, prefix cache, LRU, swap.

The state machine keeps a shadow copy of every slot's token (device and host) and checks after
every operation that each resident request's computed positions hold its own tokens — so a
prefix hit on the wrong block, a write into a shared block or a wrong swap mapping is caught
by content, on top of the counters ``check_invariants`` looks at.
"""

from __future__ import annotations

import pytest
from hypothesis import assume, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, multiple, rule

from conveyor.kv.block_pool import BlockPool
from conveyor.kv.manager import KVCacheManager, block_content, chain_hash
from conveyor.request import Request
from conveyor.sampling.params import SamplingParams

PREFIXES = [[1 + (i * 5 + j * 3) % 7 for j in range(24)] for i in range(3)]


def new_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=64, temperature=0))


def chain_hashes(tokens: list[int], block_size: int, upto: int) -> list[bytes]:
    """The prefix-cache keys of an unsalted sequence's full blocks, computed independently."""
    out: list[bytes] = []
    for i in range(upto // block_size):
        out.append(chain_hash(out[-1] if out else None, block_content(tokens[i * block_size:(i + 1) * block_size])))
    return out


class KVMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    @initialize(num_blocks=st.integers(1, 10), block_size=st.sampled_from([1, 2, 4]),
                num_host=st.integers(0, 8), caching=st.booleans())
    def setup(self, num_blocks, block_size, num_host, caching):
        self.kv = KVCacheManager(num_blocks, block_size, num_host, caching)
        self.bs = block_size
        self.caching = caching
        self.device = [[None] * block_size for _ in range(num_blocks)]
        self.host = [[None] * block_size for _ in range(num_host)]
        self.where: dict[str, str] = {}          # rid -> "device" | "host"
        self.reqs: dict[str, Request] = {}
        self.clock = 0
        self.freed_at: dict[int, int] = {}       # free cached block -> when it was freed
        self.n = 0

    # ---- helpers -----------------------------------------------------------------------------
    def _refs(self) -> list[int]:
        return [b.ref_count for b in self.kv.pool.blocks]

    def _snapshot(self):
        kv = self.kv
        return (self._refs(), list(kv.pool.free), dict(kv.pool.cached), {k: list(v) for k, v in kv.tables.items()},
                kv.host.num_free)

    def _note_released(self, table: list[int], refs_before: list[int]) -> None:
        """Timestamps for blocks that just reached ref 0, in the order the manager releases them
        (tail first)."""
        for b in reversed(table):
            block = self.kv.pool.blocks[b]
            if block.ref_count == 0 and refs_before[b] > 0:
                self.clock += 1
                if block.block_hash is not None:
                    self.freed_at[b] = self.clock

    def _check_lru_allocation(self, new_blocks: list[int], plain_free: set[int], cached_free: set[int]) -> None:
        """Plain free blocks are used before any cached one; cached ones go least recently freed first."""
        taken_cached = [b for b in new_blocks if b in cached_free]
        if taken_cached:
            event("cached block evicted")
            assert plain_free <= set(new_blocks), "evicted a cached block while plain free blocks remained"
            oldest = sorted(cached_free, key=self.freed_at.__getitem__)[:len(taken_cached)]
            assert set(taken_cached) == set(oldest), "cached blocks not evicted least-recently-freed first"
        for b in new_blocks:
            self.freed_at.pop(b, None)

    def _free_sets(self) -> tuple[set[int], set[int]]:
        pool = self.kv.pool
        cached = {b for b in pool.free if pool.blocks[b].block_hash is not None}
        return set(pool.free) - cached, cached

    def _grow(self, req: Request, n: int, cached: list[int] = ()) -> bool:
        """kv.allocate with all-or-nothing and LRU checks."""
        kv, rid = self.kv, req.request_id
        before = self._snapshot()
        plain_free, cached_free = self._free_sets()
        held = kv.num_held(rid)
        ok = kv.allocate(req, n, list(cached))
        if not ok:
            assert self._snapshot() == before, "a failed allocate changed state"
            event("allocation refused")
            need = kv.blocks_for(req.num_computed_tokens + n) - held - len(cached)
            revived = sum(1 for b in cached if before[0][b] == 0)
            assert need + revived > before[1].__len__()
            return False
        table = kv.tables[rid]
        assert len(table) == max(held + len(cached), kv.blocks_for(req.num_computed_tokens + n))
        assert table[held:held + len(cached)] == list(cached)
        refs = self._refs()
        for b in cached:
            assert refs[b] == before[0][b] + 1
            self.freed_at.pop(b, None)
        new_blocks = table[held + len(cached):]
        for b in new_blocks:
            assert before[0][b] == 0 and refs[b] == 1 and kv.pool.blocks[b].block_hash is None
            self.device[b] = [None] * self.bs
        self._check_lru_allocation(new_blocks, plain_free, cached_free - set(cached))
        return True

    # ---- rules -------------------------------------------------------------------------------
    @rule(target=requests, prefix=st.integers(0, len(PREFIXES) - 1), shared=st.integers(0, 24),
          suffix=st.lists(st.integers(1, 7), max_size=6), frac=st.floats(0, 1))
    def admit(self, prefix, shared, suffix, frac):
        tokens = PREFIXES[prefix][:shared] + suffix
        assume(tokens)
        rid = f"r{self.n}"
        self.n += 1
        req = new_request(rid, tokens)
        kv = self.kv
        cached = kv.find_cached_prefix(req)
        # the lookup: the longest run of cached full blocks, leaving >= 1 token to compute
        assert len(cached) * self.bs <= req.num_tokens - 1
        if not self.caching:
            assert cached == []
        hashes = chain_hashes(tokens, self.bs, req.num_tokens - 1)
        assert cached == [kv.pool.cached[h] for h in hashes[:len(cached)]]
        if len(cached) < len(hashes):
            # the next block is not cached, or only as one computed after another publication of
            # its parent (a stale entry: never a hit)
            nxt = kv.pool.cached.get(hashes[len(cached)])
            parent = kv.pool.blocks[cached[-1]].pub_id if cached else 0
            assert nxt is None or kv.pool.blocks[nxt].parent != parent
        assert kv.find_cached_prefix(req) == cached, "lookup is not a pure query"
        for i, b in enumerate(cached):   # a hit holds exactly these tokens
            assert self.device[b] == tokens[i * self.bs:(i + 1) * self.bs]
        if cached:
            event("prefix hit")
        req.num_computed_tokens = len(cached) * self.bs
        n = 1 + int(frac * (req.num_tokens - req.num_computed_tokens - 1))
        if not self._grow(req, n, cached):
            req.num_computed_tokens = 0
            kv.forget(req)
            return multiple()   # nothing joins the bundle
        self.reqs[rid] = req
        self.where[rid] = "device"
        return rid

    @rule(rid=requests, k=st.integers(1, 8))
    def compute(self, rid, k):
        """The executor computes k more tokens (within the table), then the manager publishes."""
        if self.where.get(rid) != "device":
            return
        req = self.reqs[rid]
        table = self.kv.tables[rid]
        room = min(len(table) * self.bs, req.num_tokens) - req.num_computed_tokens
        k = min(k, room)
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + k):
            b = table[pos // self.bs]
            block = self.kv.pool.blocks[b]
            assert block.ref_count == 1 and block.block_hash is None, "writing into a shared/cached block"
            self.device[b][pos % self.bs] = req.all_token_ids[pos]
        req.num_computed_tokens += k
        self.kv.publish_full_blocks(req)
        full = req.num_computed_tokens // self.bs
        hashes = chain_hashes(req.all_token_ids, self.bs, full * self.bs)
        for i in range(full):
            if self.caching:
                # The first holder of a hash keeps it; a duplicate is not registered, so the hash
                # may be gone (evicted with the first holder) although this request holds the data.
                holder = self.kv.pool.cached.get(hashes[i])
                if holder is not None:
                    assert self.device[holder] == req.all_token_ids[i * self.bs:(i + 1) * self.bs]
            else:
                assert not self.kv.pool.cached
        if self.caching and k and full > (req.num_computed_tokens - k) // self.bs:
            # a block that just filled is findable (by this block or an identical earlier one)
            assert hashes[full - 1] in self.kv.pool.cached, "a just-completed block was not published"

    @rule(rid=requests, tok=st.integers(1, 7), n=st.integers(1, 6))
    def decode_and_grow(self, rid, tok, n):
        """A sampled token joins the sequence; the request grows its table for n more tokens."""
        if self.where.get(rid) != "device":
            return
        req = self.reqs[rid]
        if req.num_computed_tokens == req.num_tokens:
            req.all_token_ids.append(tok)
        n = min(n, req.num_tokens - req.num_computed_tokens)
        self._grow(req, n)

    @rule(rid=consumes(requests))
    def finish(self, rid):
        if rid not in self.reqs:
            return
        req = self.reqs.pop(rid)
        kv = self.kv
        refs_before = self._refs()
        table = list(kv.tables.get(rid) or [b for b in kv.swapped_tables.get(rid, []) if b is not None])
        host_free = kv.host.num_free
        host_held = len(kv.host_tables.get(rid, []))
        kv.free(req)
        kv.forget(req)
        refs = self._refs()
        for b in set(table):
            assert refs[b] == refs_before[b] - table.count(b)
        assert kv.host.num_free == host_free + host_held
        self._note_released(table, refs_before)
        del self.where[rid]

    @rule(rid=requests)
    def swap_out(self, rid):
        kv = self.kv
        if self.where.get(rid) != "device":
            return
        req = self.reqs[rid]
        table = list(kv.tables[rid])
        refs_before = self._refs()
        moved = [b for b in table if refs_before[b] == 1]   # shared blocks stay on the device
        if not kv.can_swap_out(req):
            assert len(moved) > kv.host.num_free
            return
        host_free = set(kv.host.free_ids)
        mapping = kv.swap_out(req)
        assert [d for d, _ in mapping] == moved
        hosts = [h for _, h in mapping]
        assert len(set(hosts)) == len(hosts) and set(hosts) <= host_free
        assert kv.host_tables[rid] == hosts and rid not in kv.tables
        assert kv.swapped_tables[rid] == [None if refs_before[b] == 1 else b for b in table]
        for b in table:
            assert self.kv.pool.blocks[b].ref_count == refs_before[b] - (refs_before[b] == 1)
        for d, h in mapping:
            self.host[h] = list(self.device[d])
        self._note_released(moved, refs_before)
        self.where[rid] = "host"
        event("swap out")

    @rule(rid=requests)
    def swap_in(self, rid):
        kv = self.kv
        if self.where.get(rid) != "host":
            return
        req = self.reqs[rid]
        host = list(kv.host_tables[rid])
        if not kv.can_swap_in(req):
            assert len(host) > kv.num_free_blocks
            return
        plain_free, cached_free = self._free_sets()
        refs_before = self._refs()
        kept = list(kv.swapped_tables[rid])
        mapping = kv.swap_in(req)
        kv.end_step()   # the step that swapped it in is planned
        assert [h for h, _ in mapping] == host
        devs = [d for _, d in mapping]
        fresh = iter(devs)
        assert kv.tables[rid] == [b if b is not None else next(fresh) for b in kept]
        for d in devs:
            assert refs_before[d] == 0 and self.kv.pool.blocks[d].ref_count == 1
            assert self.kv.pool.blocks[d].block_hash is None
        self._check_lru_allocation(devs, plain_free, cached_free)
        for h, d in mapping:
            self.device[d] = list(self.host[h])
        self.where[rid] = "device"
        event("swap in")
        self.kv.publish_full_blocks(req)   # re-publishing after a swap-in must be harmless

    @rule()
    def reset_prefix_cache(self):
        self.kv.pool.reset_prefix_cache()
        for b in list(self.freed_at):
            if self.kv.pool.blocks[b].block_hash is None:
                del self.freed_at[b]

    # ---- invariants --------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        if not hasattr(self, "kv"):
            return
        kv, pool = self.kv, self.kv.pool
        kv.check_invariants(set(self.reqs))
        owners: dict[int, int] = {}
        for t in [*kv.tables.values(), *kv.swapped_tables.values()]:
            for b in t:
                if b is not None:
                    owners[b] = owners.get(b, 0) + 1
        for block in pool.blocks:
            b = block.block_id
            assert (b in pool.free) != (owners.get(b, 0) > 0), f"block {b} is both or neither free and owned"
            assert block.ref_count == owners.get(b, 0)
            if block.block_hash is not None:
                assert pool.cached[block.block_hash] == b
        assert set(pool.cached.values()) == {b.block_id for b in pool.blocks if b.block_hash is not None}
        if not self.caching:
            assert not pool.cached
        # free cached blocks are in LRU order in the queue (tail = most recently freed)
        cached_order = [b for b in pool.free if pool.blocks[b].block_hash is not None]
        assert cached_order == sorted(cached_order, key=self.freed_at.__getitem__)
        # host accounting
        used = [h for t in kv.host_tables.values() for h in t]
        assert len(set(used)) == len(used)
        assert sorted(used + kv.host.free_ids) == list(range(kv.host.num_blocks))
        # content: every computed position of a resident request holds its own token
        for rid, req in self.reqs.items():
            if self.where[rid] == "device":
                places = [(self.device, b) for b in kv.tables.get(rid, [])]
            else:   # swapped: its unshared blocks on the host, the shared ones still on the device
                hosts = iter(kv.host_tables[rid])
                places = [(self.host, next(hosts)) if b is None else (self.device, b) for b in kv.swapped_tables[rid]]
            for pos in range(req.num_computed_tokens):
                mem, b = places[pos // self.bs]
                assert mem[b][pos % self.bs] == req.all_token_ids[pos], (rid, pos)
        if not self.reqs:
            assert kv.num_free_blocks == kv.num_blocks and kv.host.num_free == kv.host.num_blocks


KVMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestKVCacheManagerStateful = KVMachine.TestCase


# ---- focused examples -----------------------------------------------------------------------------

def fill(kv: KVCacheManager, req: Request) -> None:
    """Admit with prefix hits, compute the whole sequence, publish."""
    cached = kv.find_cached_prefix(req)
    req.num_computed_tokens = len(cached) * kv.block_size
    assert kv.allocate(req, req.num_tokens - req.num_computed_tokens, cached)
    req.num_computed_tokens = req.num_tokens
    kv.publish_full_blocks(req)


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_fully_cached_prompt_leaves_one_token(block_size):
    kv = KVCacheManager(16, block_size)
    prompt = list(range(1, 4 * block_size + 1))       # a whole number of blocks
    a = new_request("a", prompt)
    fill(kv, a)
    b = new_request("b", prompt)
    hit = kv.find_cached_prefix(b)
    assert len(hit) == 3 and hit == kv.block_table("a")[:3]
    b.num_computed_tokens = len(hit) * block_size
    assert b.num_tokens - b.num_computed_tokens == block_size >= 1
    one_more = new_request("c", prompt + [99])          # one token past the cached blocks: all 4 hit
    assert kv.find_cached_prefix(one_more) == kv.block_table("a")


def test_identical_prefixes_share_blocks_by_ref_count():
    kv = KVCacheManager(12, 2)
    a = new_request("a", [1, 2, 3, 4, 5, 6, 7])
    fill(kv, a)
    reqs = [new_request(f"s{i}", [1, 2, 3, 4, 5, 6, 10 + i]) for i in range(3)]
    hits = [kv.find_cached_prefix(r) for r in reqs]
    assert hits[0] == hits[1] == hits[2] == kv.block_table("a")[:3]
    for r, h in zip(reqs, hits):
        r.num_computed_tokens = len(h) * 2
        assert kv.allocate(r, 1, h)
    for b in hits[0]:
        assert kv.pool.blocks[b].ref_count == 4
    kv.check_invariants()
    kv.free(a)
    for b in hits[0]:
        assert kv.pool.blocks[b].ref_count == 3
    for r in reqs:
        kv.free(r)
    assert kv.num_free_blocks == kv.num_blocks
    # still cached after everyone left, and found again
    assert kv.find_cached_prefix(new_request("z", [1, 2, 3, 4, 5, 6, 7])) == hits[0]


def test_lru_plain_blocks_first_then_least_recently_freed_cached():
    pool = BlockPool(6)
    a, b, c = pool.allocate(2), pool.allocate(2), pool.allocate(2)
    for i, blk in enumerate(a + b):
        pool.register(blk, 100 + i)
    pool.release(a[::-1])        # cached, freed first
    pool.release(c[::-1])        # plain
    pool.release(b[::-1])        # cached, freed last
    pool.check_invariants()
    got = pool.allocate(2)
    assert sorted(got) == sorted(c) and pool.stats.evictions == 0
    got = pool.allocate(2)
    assert got == a[::-1] and pool.stats.evictions == 2    # released tail first: the prefix's head outlives it
    assert pool.lookup(100) is None and pool.lookup(102) == b[0]
    # touching a free cached block revives it and it leaves the free queue
    pool.touch(b[1])
    assert b[1] not in pool.free and pool.blocks[b[1]].ref_count == 1
    pool.release([b[1]])
    assert list(pool.free)[-1] == b[1]                     # most recently freed at the tail
    with pytest.raises(MemoryError):
        pool.allocate(3)
    with pytest.raises(AssertionError):
        pool.release([a[0], a[0]])                         # a[0] has ref 1: the second release is a double free


def test_register_keeps_first_holder_of_a_hash():
    pool = BlockPool(4)
    x, y = pool.allocate(2)
    assert pool.register(x, 7) == x
    assert pool.register(y, 7) == x                        # a duplicate computation is not registered
    assert pool.blocks[y].block_hash is None
    pool.release([y, x])
    pool.check_invariants()
    assert pool.lookup(7) == x


def test_caching_disabled_never_caches():
    kv = KVCacheManager(8, 2, enable_prefix_caching=False)
    a = new_request("a", [1, 2, 3, 4, 5])
    fill(kv, a)
    assert not kv.pool.cached and kv.find_cached_prefix(new_request("b", [1, 2, 3, 4, 5])) == []
    kv.free(a)
    assert kv.num_free_blocks == 8


def test_swap_round_trip_mappings():
    kv = KVCacheManager(6, 2, num_host_blocks=4)
    a = new_request("a", [1, 2, 3, 4, 5])
    fill(kv, a)
    table = list(kv.block_table("a"))
    assert kv.can_swap_out(a)
    out = kv.swap_out(a)
    assert [d for d, _ in out] == table and kv.host.num_free == 1 and kv.num_free_blocks == 6
    kv.check_invariants({"a"})
    big = new_request("big", list(range(1, 10)))
    assert kv.allocate(big, 9)
    assert not kv.can_swap_out(big)                        # 5 blocks, 1 host block free
    assert not kv.can_swap_in(a)                           # 3 host blocks, 1 device block free
    kv.free(big)
    inn = kv.swap_in(a)
    kv.end_step()
    assert [h for h, _ in inn] == [h for _, h in out] and kv.host.num_free == 4
    kv.check_invariants({"a"})
    kv.free(a)
    kv.forget(a)
    assert kv.num_free_blocks == 6 and kv.host.num_free == 4 and not kv.hashes
