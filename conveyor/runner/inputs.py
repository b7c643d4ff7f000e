"""Turn one step's per-sequence work into the flattened tensors the model consumes.

Vectorised with numpy over all tokens of the step: the only Python loop is per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from conveyor.model.attention import AttentionMetadata, PrefillSeq


@dataclass(slots=True)
class SeqWork:
    """What one sequence computes this step."""

    token_ids: list[int]     # tokens whose K/V are computed now (a prompt chunk, or 1 decode token)
    num_cached: int          # tokens already in the cache before them (= position of token_ids[0])
    block_table: list[int]   # physical blocks, covering at least num_cached + len(token_ids)
    sample: bool = True      # needs logits for its last token this step


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    order: list[int]         # order[i] = index in the caller's list of the i-th laid-out sequence
    sample_order: list[int]  # caller indices of the sequences whose logits rows are returned, in row order


def build_inputs(work: list[SeqWork], block_size: int, device: torch.device | str = "cpu") -> ModelInputs:
    """Lay out prefill chunks (len > 1 or with no cache) first, then single-token decodes."""
    is_decode = [len(w.token_ids) == 1 and w.num_cached > 0 for w in work]
    order = [i for i, d in enumerate(is_decode) if not d] + [i for i, d in enumerate(is_decode) if d]
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
    slots = tables[seq_idx, positions // block_size] * block_size + positions % block_size

    prefills = []
    for r in range(n_pref):
        w = seqs[r]
        n, c = len(w.token_ids), w.num_cached
        nblocks = -(-(c + n) // block_size)
        mask = None
        if c > 0:
            mask = torch.arange(c + n, device=device)[None, :] <= (c + torch.arange(n, device=device))[:, None]
        prefills.append(PrefillSeq(int(starts[r]), n, c, torch.from_numpy(tables[r, :nblocks]).to(device), mask))

    meta = AttentionMetadata(torch.from_numpy(slots).to(device), block_size, int(starts[n_pref]), prefills)
    if n_pref < len(seqs):
        ctx = cached[n_pref:] + 1
        max_ctx = int(ctx.max())
        nb = -(-max_ctx // block_size)
        meta.decode_block_tables = torch.from_numpy(np.ascontiguousarray(tables[n_pref:, :nb])).to(device)
        bias = np.where(np.arange(max_ctx)[None, :] < ctx[:, None], 0.0, -np.inf).astype(np.float32)
        meta.decode_bias = torch.from_numpy(bias).to(device).view(1, len(ctx), 1, max_ctx)
        meta.decode_max_context = max_ctx

    sample_rows = [r for r, w in enumerate(seqs) if w.sample]
    logits_idx = starts[1:][sample_rows] - 1
    return ModelInputs(
        input_ids=torch.from_numpy(tokens).to(device),
        positions=torch.from_numpy(positions).to(device),
        meta=meta,
        logits_indices=torch.from_numpy(np.asarray(logits_idx, dtype=np.int64)).to(device),
        order=order,
        sample_order=[order[r] for r in sample_rows],
    )
