"""The logits pipeline before sampling, per row named by request id: what a request allows, biases or
bans (allowed_token_ids, logit_bias, offline logits processors, bad words), then the structured-output
grammar masks. The sampler (sampler.py) then applies min_tokens, the repetition / frequency / presence
penalties, temperature, top-k/top-p/min-p, and draws. Runs where the logits are (the model runner).
"""

from __future__ import annotations

import torch

from conveyor.sampling.row import SamplingRow
from conveyor.sampling.structured import apply_bitmask


def edit_logits(logits: torch.Tensor, ids: list[str], rows: list[SamplingRow], grammar_ids: list[str],
                grammar_bitmask: torch.Tensor | None) -> None:
    """In place: row r belongs to request ids[r] with sampling state rows[r]; the grammar bitmask has one
    row per id in grammar_ids (structured outputs: disallowed tokens to -inf)."""
    edits = [(r, row) for r, row in enumerate(rows) if row.params.has_logit_edits]
    if edits:
        apply_logit_edits(logits, edits)
    if grammar_bitmask is not None:   # (an id repeated: speculative positions, matched in order)
        rows_of: dict[str, list[int]] = {}
        for r, rid in enumerate(ids):
            rows_of.setdefault(rid, []).append(r)
        taken: dict[str, int] = {}
        rows = []
        for rid in grammar_ids:
            i = taken.get(rid, 0)
            rows.append(rows_of[rid][i])
            taken[rid] = i + 1
        apply_bitmask(logits, rows, grammar_bitmask)


def apply_logit_edits(logits: torch.Tensor, rows: list) -> None:
    """In place, per (row, SamplingRow): the allowed set, the bias, and the bad words that the
    output's last tokens would complete (a banned token gets the dtype's lowest finite value)."""
    low = torch.finfo(logits.dtype).min
    for r, row in rows:
        p = row.params
        if p.allowed_token_ids:
            keep = torch.tensor(p.allowed_token_ids, device=logits.device)
            kept = logits[r, keep].clone()
            logits[r].fill_(low)
            logits[r, keep] = kept
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
            logits[r, ids] = (logits[r, ids] + bias).clamp_min(low)
        for proc in p.logits_processors or ():
            logits[r] = proc(list(row.output_token_ids or []), logits[r])
        if p.bad_words_token_ids:
            out = row.output_token_ids or []
            banned = [w[-1] for w in p.bad_words_token_ids
                      if len(w) == 1 or (len(out) >= len(w) - 1 and out[len(out) - len(w) + 1:] == w[:-1])]
            if banned:
                logits[r, torch.tensor(banned, device=logits.device)] = low
