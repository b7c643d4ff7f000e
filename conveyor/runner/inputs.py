"""Turn one step's per-sequence work into the flattened tensors the model consumes.

Vectorised with numpy over all tokens of the step: the only Python loop is per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from conveyor.kv.layout import KVLayout
from conveyor.model.attention import AttentionMetadata, DecodeGroup, PrefillSeq

# Decodes are grouped by context length so that padding to a group's longest context wastes
# at most this fraction of the gathered KV; more groups cost more (small) kernel launches.
_GROUP_MIN_FILL = 0.6


@dataclass(slots=True)
class SeqWork:
    """What one sequence computes this step."""

    token_ids: list[int]     # tokens whose K/V are computed now (a prompt chunk, or 1 decode token)
    num_cached: int          # tokens already in the cache before them (= position of token_ids[0])
    block_table: list[int]   # physical blocks, covering at least num_cached + len(token_ids) (per group, interleaved)
    sample: bool = True      # needs logits for its last token this step
    num_logits: int = 1      # with sample: logits rows for its last this many tokens (speculative verification)


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    order: list[int]         # order[i] = index in the caller's list of the i-th laid-out sequence
    num_tokens: np.ndarray   # num_tokens[i] = flattened rows of the i-th laid-out sequence (in order)
    starts: list[int]        # starts[i] = flattened index of the caller's i-th sequence's first token
    sample_order: list[int]  # caller indices of the sequences whose logits rows are returned, in row order
    # (a sequence with num_logits > 1 has that many consecutive rows, for its last tokens in order)


def build_inputs(work: list[SeqWork], block_size: int, device: torch.device | str = "cpu",
                 max_decode_groups: int = 4, layout: KVLayout | None = None, null_block: int = 0) -> ModelInputs:
    """Lay out prefill chunks (len > 1 or with no cache) first, then single-token decodes
    sorted by context length, longest first. With a layout of several layer groups (or a
    windowed one) the tables are interleaved per group (conveyor/kv/layout.py) and the metadata
    carries each layer's own (``meta.layers``); blocks a local group gave back read `null_block`.

    A speculative verification (every token of the chunk wants logits, after a cached context) is
    laid out as one decode per token, each attending to the cache up to its own position: the KV
    of a step is written before any of its attention reads it, so token j sees the drafts before
    it, and the step can take the decode kernels (the fused loop: one weight read for all)."""
    caller = list(range(len(work)))
    if any(w.num_logits > 1 for w in work):
        work, caller = _split_verifications(work)
    is_decode = [len(w.token_ids) == 1 and w.num_cached > 0 for w in work]
    decodes = sorted((i for i, d in enumerate(is_decode) if d), key=lambda i: -work[i].num_cached)
    order = [i for i, d in enumerate(is_decode) if not d] + decodes
    seqs = [work[i] for i in order]
    n_pref = sum(1 for d in is_decode if not d)

    lens = np.fromiter((len(w.token_ids) for w in seqs), dtype=np.int64, count=len(seqs))
    starts = np.concatenate(([0], np.cumsum(lens)))
    total = int(starts[-1])
    tokens = np.fromiter((t for w in seqs for t in w.token_ids), dtype=np.int64, count=total)
    seq_idx = np.repeat(np.arange(len(seqs)), lens)
    cached = np.fromiter((w.num_cached for w in seqs), dtype=np.int64, count=len(seqs))
    positions = cached[seq_idx] + (np.arange(total) - starts[seq_idx])
    max_blocks = max(len(w.block_table) for w in seqs)
    tables = np.zeros((len(seqs), max_blocks), dtype=np.int64)
    for r, w in enumerate(seqs):
        tables[r, :len(w.block_table)] = w.block_table
    masks = []
    for r in range(n_pref):
        n, c = len(seqs[r].token_ids), seqs[r].num_cached
        masks.append(None if c == 0 else
                     torch.arange(c + n, device=device)[None, :] <= (c + torch.arange(n, device=device))[:, None])

    def group_meta(tables: np.ndarray, like: AttentionMetadata | None = None) -> AttentionMetadata:
        """The metadata over these block tables (`like`: another group's, whose decode groups'
        lengths and masks it shares)."""
        slots = tables[seq_idx, positions // block_size] * block_size + positions % block_size
        prefills = []
        for r in range(n_pref):
            n, c = len(seqs[r].token_ids), seqs[r].num_cached
            nblocks = -(-(c + n) // block_size)
            prefills.append(PrefillSeq(int(starts[r]), n, c, torch.from_numpy(tables[r, :nblocks]).to(device),
                                       masks[r]))
        if like is None:
            groups = _decode_groups(cached[n_pref:] + 1, tables[n_pref:], int(starts[n_pref]), block_size, device,
                                    max_decode_groups)
        else:
            first = n_pref - int(starts[n_pref])   # a decode group's first row: first + its start
            groups = [DecodeGroup(d.start, torch.from_numpy(np.ascontiguousarray(
                tables[first + d.start:first + d.start + d.size, :d.block_tables.shape[1]])).to(device),
                d.max_context, d.context_lens) for d in like.decodes]
        return AttentionMetadata(torch.from_numpy(slots).to(device), block_size, int(starts[n_pref]), prefills,
                                 groups)

    if layout is None or layout.trivial:
        meta = group_meta(tables)
    else:
        G = layout.num_groups
        per_group = []
        for g, w in enumerate(layout.windows):
            t = np.ascontiguousarray(tables[:, g::G])
            if w:   # blocks it gave back (stale ids in the runner's copy) read the null block
                dropped = np.maximum(0, (cached - w + 1) // block_size)   # KVLayout.dropped, per sequence
                t[np.arange(t.shape[1])[None, :] < dropped[:, None]] = null_block
            per_group.append(group_meta(t, per_group[0] if per_group else None))
        meta = per_group[layout.layer_group[0]]
        meta.layers = [per_group[g] for g in layout.layer_group]

    # Logits rows: per sampling sequence (in layout order of its first row), its rows in position order.
    rows_of: dict[int, list[int]] = {}
    for r, w in enumerate(seqs):
        if w.sample:
            last = int(starts[r + 1]) - 1
            rows_of.setdefault(caller[order[r]], []).extend(range(last - w.num_logits + 1, last + 1))
    for rows in rows_of.values():
        if len(rows) > 1:   # (a verification's pieces are laid out by context, longest first)
            rows.sort(key=lambda i: positions[i])
    logits_idx = [i for rows in rows_of.values() for i in rows]
    return ModelInputs(
        input_ids=torch.from_numpy(tokens).to(device),
        positions=torch.from_numpy(positions).to(device),
        meta=meta,
        logits_indices=torch.from_numpy(np.asarray(logits_idx, dtype=np.int64)).to(device),
        order=[caller[i] for i in order],
        num_tokens=lens,
        starts=_caller_starts(order, starts, caller),
        sample_order=list(rows_of),
    )


def _split_verifications(work: list[SeqWork]) -> tuple[list[SeqWork], list[int]]:
    """Each verification chunk as one single-token decode per position (see build_inputs), with the
    caller's index of every piece."""
    out, caller = [], []
    for i, w in enumerate(work):
        if w.num_logits > 1 and w.num_logits == len(w.token_ids) and w.num_cached > 0 and w.sample:
            out += [SeqWork([t], w.num_cached + j, w.block_table) for j, t in enumerate(w.token_ids)]
            caller += [i] * len(w.token_ids)
        else:
            out.append(w)
            caller.append(i)
    return out, caller


def _caller_starts(order: list[int], starts: np.ndarray, caller: list[int]) -> list[int]:
    """Each caller's sequence's first flattened index."""
    out = [-1] * (max(caller) + 1 if caller else 0)
    for r, i in enumerate(order):
        c = caller[i]
        out[c] = int(starts[r]) if out[c] < 0 else min(out[c], int(starts[r]))
    return out


def _decode_groups(ctx: np.ndarray, tables: np.ndarray, start: int, block_size: int,
                   device: torch.device | str, max_groups: int) -> list[DecodeGroup]:
    """Split decodes (sorted by context, longest first) into groups of similar length."""
    if len(ctx) == 0:
        return []
    bounds = [0]
    for i in range(1, len(ctx)):
        if ctx[i] < _GROUP_MIN_FILL * ctx[bounds[-1]] and len(bounds) < max_groups:
            bounds.append(i)
    bounds.append(len(ctx))
    groups = []
    for lo, hi in zip(bounds, bounds[1:]):
        g_ctx = ctx[lo:hi]
        max_ctx = int(g_ctx[0])
        nb = -(-max_ctx // block_size)
        groups.append(DecodeGroup(
            start + lo, torch.from_numpy(np.ascontiguousarray(tables[lo:hi, :nb])).to(device), max_ctx,
            torch.from_numpy(np.ascontiguousarray(g_ctx)).to(device)))
    return groups
