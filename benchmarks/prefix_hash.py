"""Cost of the prefix cache's block keys: the old Python hash() chain vs the sha256 chain, and of a
verified lookup.

A 2,048-token prompt in 16-token blocks (128 blocks): the time to key every block (done once per
request, incrementally), and the time of ``find_cached_prefix`` when every block hits (keys
already computed; each hit compares the block's content bytes and parent).

    python benchmarks/prefix_hash.py [--tokens 2048] [--block-size 16]
"""

from __future__ import annotations

import argparse
import json
import random
import timeit

from conveyor.kv.manager import KVCacheManager, block_content, chain_hash
from conveyor.request import Request
from conveyor.sampling.params import SamplingParams


def old_chain(tokens: list[int], bs: int) -> list[int]:
    out: list[int] = []
    for i in range(len(tokens) // bs):
        out.append(hash((out[-1] if out else None, tuple(tokens[i * bs:(i + 1) * bs]))))
    return out


def new_chain(tokens: list[int], bs: int) -> list[bytes]:
    out: list[bytes] = []
    for i in range(len(tokens) // bs):
        out.append(chain_hash(out[-1] if out else None, block_content(tokens[i * bs:(i + 1) * bs])))
    return out


def best(fn, number: int) -> float:
    """Seconds per call: the best of 7 repeats (the least disturbed by other load)."""
    return min(timeit.repeat(fn, number=number, repeat=7)) / number


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    rng = random.Random(0)
    tokens = [rng.randrange(150_000) for _ in range(args.tokens)]
    bs, blocks = args.block_size, args.tokens // args.block_size

    old = best(lambda: old_chain(tokens, bs), 500)
    new = best(lambda: new_chain(tokens, bs), 500)

    kv = KVCacheManager(blocks + 8, bs)
    owner = Request("owner", tokens + [1], SamplingParams(max_tokens=1))
    assert kv.allocate(owner, owner.num_tokens)
    owner.num_computed_tokens = owner.num_tokens
    kv.publish_full_blocks(owner)
    probe = Request("probe", tokens + [2], SamplingParams(max_tokens=1))
    assert len(kv.find_cached_prefix(probe)) == blocks
    lookup = best(lambda: kv.find_cached_prefix(probe), 500)
    keys = kv.hashes["probe"].hashes

    def unverified() -> list[int]:   # the old loop: trust the key
        found = []
        for h in keys:
            block_id = kv.pool.lookup(h)
            if block_id is None:
                break
            found.append(block_id)
        return found

    assert len(unverified()) == blocks
    plain = best(unverified, 500)

    result = {"tokens": args.tokens, "block_size": bs, "blocks": blocks,
              "hash_chain_us": round(old * 1e6, 1), "sha256_chain_us": round(new * 1e6, 1),
              "hash_ns_per_block": round(old * 1e9 / blocks), "sha256_ns_per_block": round(new * 1e9 / blocks),
              "unverified_lookup_all_hits_us": round(plain * 1e6, 1),
              "verified_lookup_all_hits_us": round(lookup * 1e6, 1),
              "verified_lookup_ns_per_block": round(lookup * 1e9 / blocks)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
