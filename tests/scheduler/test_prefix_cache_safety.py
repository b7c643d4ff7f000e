"""The prefix cache never hands a sequence KV it did not ask for, even when keys collide, and
``cache_salt`` separates requests: sha256 chained keys, checked on every hit (content + parent)."""

from __future__ import annotations

import hashlib
from array import array

import pytest

import conveyor.kv.block_keys as block_keys
from conveyor.kv.manager import KVCacheManager, block_content, chain_hash
from conveyor.request import Request
from conveyor.sampling.params import SamplingParams


def new_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=8, temperature=0), cache_salt=salt)


def fill(kv: KVCacheManager, req: Request) -> list[int]:
    """Admit with prefix hits, compute the whole sequence, publish; returns the hits."""
    cached = kv.find_cached_prefix(req)
    req.num_computed_tokens = len(cached) * kv.block_size
    assert kv.allocate(req, req.num_tokens - req.num_computed_tokens, cached)
    req.num_computed_tokens = req.num_tokens
    kv.publish_full_blocks(req)
    kv.check_invariants()
    return cached


# ---- the key ---------------------------------------------------------------------------------

def test_key_is_a_sha256_chain_over_a_fixed_encoding():
    content = block_content([1, 2, 70000])
    assert content == (0).to_bytes(4, "little") + array("i", [1, 2, 70000]).tobytes()
    assert len(content) == 4 + 3 * 4
    k0 = chain_hash(None, content)
    assert k0 == hashlib.sha256(bytes(32) + content).digest() and len(k0) == 32
    assert chain_hash(k0, content) != k0                        # the parent is part of the key
    assert block_content([1], b"s\x01\x00\x00\x00a") != block_content([1])


def test_salt_goes_into_the_first_block_and_every_key_chains_from_it():
    kv = KVCacheManager(16, 2)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    keys = {}
    for salt in (None, "a", "b"):
        req = new_request(f"r{salt}", tokens, salt)
        kv.find_cached_prefix(req)
        keys[salt] = kv.hashes[req.request_id]
    assert keys["a"].contents[1:] == keys[None].contents[1:]   # only the first block carries the salt
    assert keys["a"].contents[0] != keys[None].contents[0]
    for x, y in ((None, "a"), ("a", "b"), (None, "b")):
        assert not set(keys[x].hashes) & set(keys[y].hashes)   # no block key is shared across salts


# ---- collisions --------------------------------------------------------------------------------

def test_forced_collision_on_every_key_shares_nothing(monkeypatch):
    monkeypatch.setattr(block_keys, "chain_hash", lambda parent, content: b"\x00" * 32)
    kv = KVCacheManager(16, 4)
    a = new_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    fill(kv, a)
    assert list(kv.pool.cached) == [b"\x00" * 32]                  # a's block 0; block 1 collided with it
    b = new_request("b", [11, 12, 13, 14, 15, 16, 17, 18, 19])
    assert kv.pool.lookup(b"\x00" * 32) == kv.block_table("a")[0]   # the key is there ...
    assert kv.find_cached_prefix(b) == []                          # ... but holds other tokens: a miss
    assert kv.pool.stats.mismatches >= 1
    assert fill(kv, b) == []
    assert not set(kv.block_table("a")) & set(kv.block_table("b"))
    assert all(kv.ref_count(blk) == 1 for blk in kv.block_table("b"))
    # the holder of the key is a's first block, with a's tokens: a request with those tokens still hits it
    again = new_request("again", [1, 2, 3, 4, 5, 6, 7, 8, 10])
    assert kv.find_cached_prefix(again) == kv.block_table("a")[:1]
    # a free holder of a colliding key gives it up to the next block published under it
    kv.free(a)
    c = new_request("c", [21, 22, 23, 24, 25])
    assert fill(kv, c) == []
    assert kv.pool.lookup(b"\x00" * 32) == kv.block_table("c")[0]
    assert kv.find_cached_prefix(new_request("d", [21, 22, 23, 24, 26])) == kv.block_table("c")[:1]


def test_same_tokens_after_another_prefix_do_not_match(monkeypatch):
    """A key that ignores the parent (a forced collision of (x, y) with (x', y)): the block's own
    tokens match, but it was computed after x, not x'; the parent check makes it a miss."""
    monkeypatch.setattr(block_keys, "chain_hash", lambda parent, content: hashlib.sha256(content).digest())
    kv = KVCacheManager(16, 2)
    a = new_request("a", [1, 2, 3, 4, 9])     # x = [1, 2], y = [3, 4]
    c = new_request("c", [5, 6, 7, 8, 9])     # x' = [5, 6]
    fill(kv, a)
    fill(kv, c)
    b = new_request("b", [5, 6, 3, 4, 9])     # x', y
    hit = kv.find_cached_prefix(b)
    key = kv.hashes["b"].hashes[1]
    assert kv.pool.lookup(key) == kv.block_table("a")[1]           # the key collides with a's (x, y) block
    assert hit == kv.block_table("c")[:1]                          # x' from c, and y is not taken from a
    fill(kv, b)
    assert kv.block_table("b")[1] not in kv.block_table("a")


def test_real_keys_never_mismatch_in_ordinary_use():
    kv = KVCacheManager(32, 2)
    for i in range(6):
        fill(kv, new_request(f"r{i}", [1, 2, 3, 4, 5 + i % 2, 6, 7 + i]))
    assert kv.pool.stats.mismatches == 0 and kv.pool.stats.prefix_hits == 0   # record_prefix_lookup not called
    assert kv.find_cached_prefix(new_request("x", [1, 2, 3, 4, 6, 6, 0])) == kv.block_table("r1")[:3]


def test_republished_parent_keeps_cached_successors():
    """r's block 1 was computed after a's copy of block 0 (r's own copy was a duplicate). When a's
    copy is evicted and block 0 is published again (same tokens, same parent), the publication
    id is reused, so r's block 1 still matches after it."""
    kv = KVCacheManager(8, 2)
    a = new_request("a", [1, 2, 9])
    fill(kv, a)
    r = new_request("r", [1, 2, 3, 4, 5])
    r.num_computed_tokens = 0
    assert kv.allocate(r, r.num_tokens)                  # computed without the cache: block 0 is a duplicate
    r.num_computed_tokens = r.num_tokens
    kv.publish_full_blocks(r)
    a0, r1 = kv.block_table("a")[0], kv.block_table("r")[1]
    assert kv.pool.blocks[r1].parent == kv.pool.blocks[a0].pub_id
    kv.free(a)
    filler = new_request("f", list(range(1, 11)))
    assert kv.allocate(filler, kv.num_free_blocks * 2)   # takes every free block: a's block 0 is evicted
    assert kv.pool.blocks[a0].block_hash is None
    kv.free(filler)
    s = new_request("s", [1, 2, 3, 4, 6])
    assert fill(kv, s) == []                             # block 0 is gone, so block 1 cannot be reached
    t = new_request("t", [1, 2, 3, 4, 7])
    assert kv.find_cached_prefix(t) == [kv.block_table("s")[0], r1]
    assert kv.pool.stats.mismatches == 0


# ---- cache_salt --------------------------------------------------------------------------------

@pytest.mark.parametrize("first,second,shared", [("a", "a", True), ("a", "b", False), (None, "a", False),
                                                  ("a", None, False), (None, None, True)])
def test_salts_separate_prefix_blocks(first, second, shared):
    kv = KVCacheManager(16, 2)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    fill(kv, new_request("x", tokens, first))
    hit = fill(kv, new_request("y", tokens, second))
    assert hit == (kv.block_table("x")[:3] if shared else [])
    assert bool(set(kv.block_table("x")) & set(kv.block_table("y"))) == shared
