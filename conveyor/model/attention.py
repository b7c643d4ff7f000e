"""Paged attention over a flattened batch of tokens from many sequences.

A step's tokens are laid out prefill chunks first (one contiguous run per sequence), then
one token per decoding sequence. New K/V are written into the paged cache through the slot
mapping before attention, so every query sees its whole context through its block table.

Cache layout per layer: ``[kv_heads, num_blocks, block_size, head_dim]`` for K and for V.
Keeping the head axis outermost means gathering a batch's blocks with one ``index_select``
yields ``[kv_heads, seqs, context, head_dim]`` -- directly a batched-matmul operand, with no
permute-and-copy of the gathered context per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from conveyor.model.cpu_kernels import cpu_kernels


@dataclass(slots=True)
class PrefillSeq:
    """One sequence computing a chunk of >= 1 prompt tokens this step."""

    query_start: int            # offset of its first token in the flattened batch
    query_len: int              # tokens computed this step
    num_cached: int             # tokens of context already in the cache before this chunk
    block_table: torch.Tensor   # [blocks covering num_cached + query_len] long
    mask: torch.Tensor | None   # [query_len, num_cached + query_len] bool (True = attend); None => causal, no cache


@dataclass(slots=True)
class DecodeGroup:
    """Decoding sequences of similar context length, padded to the group's longest."""

    start: int                  # offset of the group's first token in the flattened batch
    block_tables: torch.Tensor  # [D, max_blocks] long (padded with 0)
    max_context: int
    context_lens: torch.Tensor  # [D] long
    _bias: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.block_tables.shape[0]

    @property
    def bias(self) -> torch.Tensor:
        """[1, D, 1, max_context] float: 0, or -inf past a sequence's end -- for the torch path's
        padded attention, made on first use: the C++ kernel reads the lengths, and a mask built every
        step would cost in proportion to how long the sequences have run."""
        if self._bias is None:
            pos = torch.arange(self.max_context, device=self.context_lens.device)
            past = pos[None, :] >= self.context_lens[:, None]   # [D, max_context]
            self._bias = torch.zeros(past.shape, dtype=torch.float32, device=pos.device) \
                .masked_fill_(past, float("-inf")).view(1, self.size, 1, -1)
        return self._bias


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor              # [T] long: cache slot (block * block_size + offset) per token
    block_size: int
    num_prefill_tokens: int
    prefills: list[PrefillSeq]
    decodes: list[DecodeGroup]
    # Per layer, when layer groups have their own block tables (conveyor/kv/layout.py); None: this one for all.
    layers: list[AttentionMetadata] | None = None


class AttentionBackend(Protocol):
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata, window: int = 0) -> torch.Tensor: ...


def window_mask(mask: torch.Tensor | None, query_len: int, num_cached: int, window: int,
                device: torch.device) -> torch.Tensor:
    """`mask` ([query_len, num_cached + query_len] bool; None: causal) restricted to each query's
    last `window` positions (its own included)."""
    total = num_cached + query_len
    q_pos = torch.arange(num_cached, total, device=device).unsqueeze(1)
    k_pos = torch.arange(total, device=device).unsqueeze(0)
    near = (q_pos - k_pos < window) & (k_pos <= q_pos)
    return near if mask is None else mask & near


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    kv_heads, _, _, head_dim = k_cache.shape
    k_cache.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, v.transpose(0, 1))


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """Blocks of each row of ``block_tables`` as ``[kv_heads, rows, length, head_dim]``."""
    kv_heads, num_blocks, block_size, head_dim = cache.shape
    rows, blocks = block_tables.shape
    flat = block_tables.reshape(-1)
    out = torch.empty(kv_heads, rows * blocks, block_size * head_dim, dtype=cache.dtype, device=cache.device)
    # One contiguous gather per head along the leading axis: ~5x faster on CPU than
    # index_select along the blocks axis of the 4-D cache.
    for h in range(kv_heads):
        torch.index_select(cache[h].view(num_blocks, -1), 0, flat, out=out[h])
    return out.view(kv_heads, rows, blocks * block_size, head_dim)[:, :, :length]


class TorchPagedAttention:
    """Portable paged attention built from torch ops (CPU and CUDA)."""

    # Decodes are gathered and padded per group, so grouping by context length pays off.
    max_decode_groups = 4

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else scale

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata, window: int = 0) -> torch.Tensor:
        """q: [T, H, d]; k, v: [T, KVH, d]. Returns [T, H * d]. `window` > 0: each query attends to
        its last `window` positions only (a sliding-window layer)."""
        self._write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if not meta.prefills and len(meta.decodes) == 1:   # a decode-only step: no copy into a buffer
            return self._decode(q, k_cache, v_cache, meta.decodes[0], window)
        out = torch.empty(q.shape[0], self.num_heads * self.head_dim, dtype=q.dtype, device=q.device)
        for seq in meta.prefills:
            sl = slice(seq.query_start, seq.query_start + seq.query_len)
            out[sl] = self._prefill(q[sl], k[sl], v[sl], k_cache, v_cache, seq, window)
        for group in meta.decodes:
            sl = slice(group.start, group.start + group.size)
            out[sl] = self._decode(q[sl], k_cache, v_cache, group, window)
        return out

    @staticmethod
    def _write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
        write_kv(k, v, k_cache, v_cache, slot_mapping)

    def _prefill(self, q, k, v, k_cache, v_cache, seq: PrefillSeq, window: int = 0) -> torch.Tensor:
        qh = q.transpose(0, 1).unsqueeze(0)                            # [1, H, n, d]
        mask = seq.mask
        if window and seq.num_cached + seq.query_len > window:   # some query sees fewer than all keys
            mask = window_mask(mask, seq.query_len, seq.num_cached, window, q.device)
        if seq.mask is None:   # no cache: this chunk's own keys, causal (and windowed: `mask`)
            kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                                               enable_gqa=True)
        else:
            total = seq.num_cached + seq.query_len
            bt = seq.block_table.unsqueeze(0)
            if window and seq.num_cached >= window:   # blocks no query of the chunk sees: not gathered
                skip = (seq.num_cached - window + 1) // k_cache.shape[2]
                bt, total, mask = bt[:, skip:], total - skip * k_cache.shape[2], mask[:, skip * k_cache.shape[2]:]
            kh = gather_context(k_cache, bt, total).transpose(0, 1)     # [1, KVH, total, d]
            vh = gather_context(v_cache, bt, total).transpose(0, 1)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return o[0].transpose(0, 1).reshape(q.shape[0], -1)

    def _decode(self, q, k_cache, v_cache, group: DecodeGroup, window: int = 0) -> torch.Tensor:
        d = q.shape[0]
        kh = gather_context(k_cache, group.block_tables, group.max_context)  # [KVH, D, L, d]
        vh = gather_context(v_cache, group.block_tables, group.max_context)
        # The query heads of one KV group become the query "length" of that (KVH, seq) pair.
        qh = q.view(d, self.num_kv_heads, self.group, self.head_dim).transpose(0, 1)   # [KVH, D, G, d]
        bias = group.bias
        if window and group.max_context > window:   # positions before each sequence's window: -inf
            far = torch.arange(group.max_context, device=q.device) < (group.context_lens - window).unsqueeze(1)
            bias = bias.masked_fill(far.view(1, d, 1, -1), float("-inf"))
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, scale=self.scale)
        return o.transpose(0, 1).reshape(d, -1)


class CpuPagedAttention(TorchPagedAttention):
    """Decodes through the C++ kernel that reads K/V (fp32 or bf16) in place via the block
    tables; prefills through the torch path (compute-bound, where SDPA is already efficient), or,
    with `rowwise_prefill`, through the decode kernel one query at a time: every query's numbers
    are then those of the same token decoded (SDPA sums in another order), whatever chunk, prefix
    hit or recomputation brought it there -- at 1-1.6x SDPA's time for the prefill's attention in fp32
    and 2.6-3.8x in bf16 (256-2,000 tokens, benchmarks/attention_prefill.py on an AMX Xeon)."""

    max_decode_groups = 1

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, kernels, scale: float | None = None):
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.kernels = kernels
        self.rowwise_prefill = False   # set by loader.build_model (batch_invariant_attention)

    def _prefill(self, q, k, v, k_cache, v_cache, seq: PrefillSeq, window: int = 0) -> torch.Tensor:
        if not self.rowwise_prefill:
            return super()._prefill(q, k, v, k_cache, v_cache, seq, window)
        # Query i sees the cache up to its own position, through the chunk's one table (not copied).
        n, c = seq.query_len, seq.num_cached
        lens = torch.arange(c + 1, c + n + 1, device=q.device)
        o = self.kernels.paged_decode(q, k_cache, v_cache, seq.block_table.unsqueeze(0).expand(n, -1), lens,
                                      self.scale, window)
        return o.view(n, -1)

    def _write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        self.kernels.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def _decode(self, q, k_cache, v_cache, group: DecodeGroup, window: int = 0) -> torch.Tensor:
        o = self.kernels.paged_decode(q, k_cache, v_cache, group.block_tables, group.context_lens, self.scale, window)
        return o.view(q.shape[0], -1)


def make_attention_backend(num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device | str,
                           dtype: torch.dtype, scale: float | None = None) -> TorchPagedAttention:
    """The fastest backend available for the device and dtype, else the portable one. `scale`:
    the query scale (default 1/sqrt(head_dim))."""
    kernels = cpu_kernels(device, dtype)
    if kernels is not None:
        return CpuPagedAttention(num_heads, num_kv_heads, head_dim, kernels, scale)
    return TorchPagedAttention(num_heads, num_kv_heads, head_dim, scale)
