"""Prefix-cache keys of a request's full blocks.

Block i's key is sha256(key of block i-1, or ROOT_HASH for the first block || content_i),
content_i = u32 length of the extra keys || the extra keys || the block's token ids as int32,
little-endian. Only the first block has extra keys (the cache salt), so everything chains from
them. The pool also compares content and parent on every hit (block_pool.py).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from conveyor.lora.request import adapter_key
from conveyor.request import Request
from conveyor.routing import salt_extra_keys

ROOT_HASH = bytes(32)
assert array("i").itemsize == 4
_BIG_ENDIAN = sys.byteorder == "big"


def extra_keys(request: Request) -> bytes:
    """What besides its tokens changes a sequence's KV, as tagged, length-prefixed fields that go
    into its first block's key: its LoRA adapter and its cache salt (routing.salt_extra_keys, which the
    router computes alike). Anything else that would (multimodal inputs) joins here."""
    return salt_extra_keys(request.cache_salt, adapter_key(request.lora))


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

    def extend(self, request: Request, upto_tokens: int, block_size: int) -> BlockKeys:
        """Compute the keys of the request's full blocks within its first upto_tokens tokens."""
        hashes, contents, bs, toks = self.hashes, self.contents, block_size, request.all_token_ids
        for i in range(len(hashes), upto_tokens // bs):
            content = block_content(toks[i * bs:(i + 1) * bs], b"" if i else extra_keys(request))
            hashes.append(chain_hash(hashes[-1] if hashes else None, content))
            contents.append(content)
        return self

    def parent_key(self, i: int) -> bytes:
        """The key block i is chained after (ROOT_HASH for the first block)."""
        return self.hashes[i - 1] if i else ROOT_HASH
