"""The router policy: which engine replica gets a request. One policy for every router.

The data-parallel server (``transport/data_parallel.py``), the simulator (``sim/harness.py``) and
a request router in front of separate engines (e.g. Ray's) all decide with ``Router.choose``:
the prompt's token ids (and its cache salt), the replicas' current loads, and the router's own
record of which replica holds which prefix. No I/O, no clock, no randomness, standard library
only: it sits at the bottom of the layers, so anything may import it.

Policies:

- ``round-robin``: the next live replica in turn;
- ``least-load``: the live replica with the lowest load (``replica_load``: unfinished requests,
  KV usage breaking ties; the lower index on a tie);
- ``prefix``: the replica holding (or, failing that, last sent) the longest matching prompt prefix
  (the first 1..``prefix_blocks`` full KV blocks), unless its load exceeds the least loaded live
  replica's by more than ``balance_slack`` — then least-load, and the prefix moves there. A
  prompt shorter than one block goes by load.

What each replica holds, the router learns from the replicas' KV cache events (``learn``: the
wire form of ``kv/events.py``, the stream vLLM defined and llm-d's indexer reads): blocks stored
in a replica's cache count for it, and leave it with their removal or a cleared cache. A replica
holding at least as long a run of the prompt's blocks as the one it was last sent to wins. Until
a replica's events say it stored a prompt's blocks (they are published after its prefill step),
the router goes by where it last sent that prefix, so a burst of prompts sharing a preamble stays
together. Without events (``learn`` never called) that memory is all it has.

A load of ``None`` means the replica is down: no policy picks it.

Prefix keys are the KV cache's own block keys (``kv/manager.py``): block i's key is
sha256(key of block i-1, or 32 zero bytes || u32 length of the extra keys || the extra keys ||
the block's token ids as little-endian int32), the cache salt the first block's only extra key.
So they are stable across processes and machines (no Python ``hash()``), two requests with
different salts never share a key (and so are never routed by each other's prefixes), and a
router that learns from KV cache events (``kv/events.py``) sees the same keys.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence

POLICIES = ("prefix", "least-load", "round-robin")
ALIASES = {"least-loaded": "least-load"}   # the simulator's older name
ROOT_KEY = bytes(32)


class NoReplicaError(RuntimeError):
    """Every replica is down (the data-parallel engine raises its EngineDeadError instead)."""


def policy_name(name: str) -> str:
    """The policy's canonical name (aliases resolved); ValueError for an unknown one."""
    policy = ALIASES.get(name, name)
    if policy not in POLICIES:
        raise ValueError(f"router must be one of {', '.join(POLICIES)}, got {name!r}")
    return policy


def replica_load(num_unfinished_requests: int, kv_usage: float) -> float:
    """A replica's load as every router measures it: its unfinished requests, plus half its KV
    usage (0..1) to break ties between replicas with as many requests."""
    return num_unfinished_requests + 0.5 * kv_usage


def salt_extra_keys(cache_salt: str | None, adapter: str | None = None) -> bytes:
    """The first block's extra keys, as the KV cache writes them (kv/block_keys.py): the LoRA
    adapter's key (``LoRARequest.cache_key``), then the cache salt, each tagged and length-prefixed."""
    out = b""
    for tag, value in ((b"l", adapter), (b"s", cache_salt)):
        if value is not None:
            raw = value.encode("utf-8", "surrogatepass")
            out += tag + len(raw).to_bytes(4, "little") + raw
    return out


def prefix_keys(token_ids: Sequence[int], block_size: int, max_blocks: int,
                cache_salt: str | None = None, adapter: str | None = None) -> list[bytes]:
    """The KV-cache keys of the prompt's first 1..max_blocks full blocks (none under one block)."""
    full = min(max_blocks, len(token_ids) // block_size)
    keys: list[bytes] = []
    parent, extra = ROOT_KEY, salt_extra_keys(cache_salt, adapter)
    for i in range(full):
        ids = array("i", token_ids[i * block_size:(i + 1) * block_size])
        if sys.byteorder == "big":
            ids.byteswap()
        parent = hashlib.sha256(parent + struct.pack("<I", len(extra)) + extra + ids.tobytes()).digest()
        keys.append(parent)
        extra = b""
    return keys


def external_hash(key: bytes) -> int:
    """A prefix-cache key as KV events carry it: its last 8 bytes as a big-endian unsigned int."""
    return int.from_bytes(key[-8:], "big")


class CacheIndex:
    """The prefix blocks each replica's KV cache holds (their external hashes), as its KV events
    say. Blocks in host memory (medium "CPU": a swapped-out request's copy) do not count: a new
    request cannot hit them."""

    DEVICE = "GPU"   # the KV cache's medium in the events (kv/events.py's MEDIUM_DEVICE)

    def __init__(self) -> None:
        self._held: dict[int, set[int]] = {}

    def apply(self, replica: int, events: Sequence[Mapping]) -> None:
        """Replica `replica`'s events (maps tagged by "type"), in the order it published them."""
        held = self._held.setdefault(replica, set())
        for e in events:
            kind = e.get("type")
            if kind == "BlockStored" and e.get("medium") in (None, self.DEVICE):
                held.update(e["block_hashes"])
            elif kind == "BlockRemoved" and e.get("medium") in (None, self.DEVICE):
                held.difference_update(e["block_hashes"])
            elif kind == "AllBlocksCleared":
                held.clear()

    def leading(self, replica: int, hashes: Sequence[int]) -> int:
        """How many of `hashes` (a prompt's block chain), from the first, the replica holds."""
        held = self._held.get(replica, ())
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def blocks(self, replica: int) -> int:
        return len(self._held.get(replica, ()))

    def clear(self, replica: int) -> None:
        self._held.pop(replica, None)


class Router:
    """Picks a replica for a prompt from the replicas' current loads (None = the replica is down).

    State: the round-robin position and, for ``prefix``, an LRU map from prefix key to the
    replica it was last sent to (at most ``max_prefixes`` keys) and, once ``learn`` is fed the
    replicas' KV events, a ``CacheIndex`` of what each holds. One instance per set of replicas.
    """

    def __init__(self, policy: str = "prefix", block_size: int = 16, prefix_blocks: int = 4,
                 balance_slack: float = 8, max_prefixes: int = 100_000):
        self.policy = policy_name(policy)
        self.block_size = block_size
        self.prefix_blocks = prefix_blocks
        self.balance_slack = balance_slack
        self.max_prefixes = max_prefixes
        self._next = 0
        self._owner: OrderedDict[int, int] = OrderedDict()   # prefix key's external hash -> replica (LRU)
        self.index: CacheIndex | None = None   # what the replicas hold, once learn() is called
        self.prefix_routed = 0    # requests sent where their prefix was held or seen before
        self.held_routed = 0      # ... of which: where a replica's events said it held the prefix

    def learn(self, replica: int, events: Sequence[Mapping]) -> None:
        """A replica's KV cache events (kv/events.py's wire form: maps tagged by "type", in the
        order it published them): what it stores counts for it, what it removes (or a cleared
        cache) no longer does. Where prefixes were sent is not forgotten on an eviction: a group
        of prompts that keeps going to one replica rebuilds its blocks there, instead of spreading
        over every cache (in the simulator, dropping it cost a few points of prefix-cache hits
        with small caches)."""
        if self.index is None:
            self.index = CacheIndex()
        self.index.apply(replica, events)

    def choose(self, token_ids: Sequence[int], loads: Sequence[float | None],
               cache_salt: str | None = None, adapter: str | None = None) -> int:
        """The replica (an index into `loads`) for this prompt; records its prefix there.
        Raises NoReplicaError when every load is None."""
        live = [i for i, load in enumerate(loads) if load is not None]
        if not live:
            raise NoReplicaError("every engine replica is down")
        if self.policy == "round-robin":
            n = len(loads)
            for k in range(n):
                i = (self._next + k) % n
                if loads[i] is not None:
                    self._next = i + 1
                    return i
        least = min(live, key=lambda i: (loads[i], i))
        if self.policy == "least-load":
            return least
        keys = [external_hash(k) for k in prefix_keys(token_ids, self.block_size, self.prefix_blocks, cache_salt,
                                                      adapter)]
        held, held_n = None, 0   # the live replica whose cache holds the longest run of the prompt's blocks
        if self.index is not None and keys:
            for i in live:
                n = self.index.leading(i, keys)
                if n > held_n or (n and n == held_n and loads[i] < loads[held]):
                    held, held_n = i, n
        sent, sent_n = None, 0   # the live replica the longest of them was last sent to
        for n in range(len(keys), 0, -1):
            owner = self._owner.get(keys[n - 1])
            if owner is not None and owner < len(loads) and loads[owner] is not None:
                sent, sent_n = owner, n
                break
        # What a cache holds wins; a longer prefix sent since (its blocks not stored yet) wins over it.
        owner = held if held_n and held_n >= sent_n else sent
        choice = least
        if owner is not None and loads[owner] - loads[least] <= self.balance_slack:
            choice = owner
            self.prefix_routed += 1
            self.held_routed += owner == held
        for key in keys:
            self._owner[key] = choice
            self._owner.move_to_end(key)
        while len(self._owner) > self.max_prefixes:
            self._owner.popitem(last=False)
        return choice

    def owner(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int | None:
        """The replica recorded for the prompt's longest known prefix (None: none known). Read only."""
        for key in reversed(prefix_keys(token_ids, self.block_size, self.prefix_blocks, cache_salt)):
            owner = self._owner.get(external_hash(key))
            if owner is not None:
                return owner
        return None

    def forget_replica(self, replica: int) -> None:
        """Drop every prefix recorded for a replica (it was removed, or restarted with an empty cache)."""
        for key in [k for k, r in self._owner.items() if r == replica]:
            del self._owner[key]
        if self.index is not None:
            self.index.clear(replica)


__all__ = ["ALIASES", "POLICIES", "CacheIndex", "NoReplicaError", "Router", "external_hash", "policy_name",
           "prefix_keys", "replica_load"]
