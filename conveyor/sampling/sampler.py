"""Turns one step's logits into one token per sequence: batched, seeded, device-agnostic.

Order of processing (as in vLLM): min_tokens masking, penalties, then greedy rows take the
argmax while random rows go through temperature, top-k, top-p and min-p and draw one token
by inverse-CDF sampling with a uniform that depends only on (seed, output length).
Logprobs are taken from the raw logits, before any of that.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from conveyor.sampling.params import SAMPLING_EPS, SamplingParams
from conveyor.sampling.row import SamplingRow

__all__ = ["Sampler", "SamplerOutput", "SamplingRow", "NonFiniteLogitsError", "uniforms"]


class NonFiniteLogitsError(FloatingPointError):
    """The model produced NaN logits (or no finite logit) for a row: nothing can be sampled."""


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # Per row: {token_id: logprob} for the top params.logprobs tokens plus the sampled one;
    # None where params.logprobs is None.
    logprobs: list[dict[int, float] | None]
    # Per row: 1-based rank of the sampled token under the raw logits; None without logprobs.
    ranks: list[int | None]


class Sampler:
    def __init__(self, argmax_rows: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None):
        # A fused (first argmax, max) per row, e.g. the C++ CPU kernel; else torch's max.
        self.argmax_rows = argmax_rows

    def _greedy(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.argmax_rows is not None and logits.is_contiguous():
            return self.argmax_rows(logits)
        best, tokens = logits.max(dim=-1)
        return tokens, best

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
        if all(_plain_greedy(r) for r in rows):
            tokens, best = self._greedy(logits)
            _check_finite(best)
            return SamplerOutput(tokens.tolist(), [None] * len(rows), [None] * len(rows))
        raw = logits
        _check_finite(logits.amax(dim=-1))
        if any(r.params.needs_penalties or r.num_output_tokens < r.params.min_tokens for r in rows):
            # The edits below are in place (on a flat view); the caller's tensor stays raw.
            logits = logits.clone(memory_format=torch.contiguous_format)
            _apply_min_tokens(logits, rows)
            _apply_penalties(logits, rows)
        tokens = _sample(logits, rows)
        logprobs, ranks = _gather_logprobs(raw, rows, tokens)
        return SamplerOutput(tokens.tolist(), logprobs, ranks)


    def verify(self, logits: torch.Tensor, rows: list[SamplingRow], drafts: list[int]) -> VerifyOutput:
        """Speculative decoding's verification, one logits row per position: row i tests the proposed
        token drafts[i] (-1: none, a request's last position or one that proposed nothing). rows[i] is
        the row's sampling state at its own position (its num_output_tokens counts the tokens before
        it, its output history includes the drafts before it).

        Each row draws its token exactly as the sampler would without speculation at that position
        (the argmax, or the seeded inverse-CDF draw from the row's final distribution), and accepts
        its draft iff the draft is that token. For a proposer that proposes one token with
        certainty this accepts with probability p(draft), as the rejection sampling of Leviathan et
        al. and Chen et al. (2023) does, and it emits the very token the request would have got
        without speculation: greedy and seeded outputs do not depend on what was proposed."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows) == len(drafts), (tuple(logits.shape), len(rows))
        result = self(logits, rows)
        accepted = [d >= 0 and d == t for d, t in zip(drafts, result.token_ids)]
        return VerifyOutput(accepted, result.token_ids, result.logprobs, result.ranks)


@dataclass(slots=True)
class VerifyOutput:
    """Per row of a verification: whether its draft was accepted, the token the row emits (the draft
    when accepted), and that token's logprobs and rank (None where not asked). A request's emitted
    tokens are its rows' up to its first refused draft."""

    accepted: list[bool]
    emitted: list[int]
    logprobs: list[dict[int, float] | None]
    ranks: list[int | None]


def _check_finite(row_max: torch.Tensor) -> None:
    """A row whose largest logit is NaN (max propagates NaN) or infinite cannot be sampled.
    (Checked on the host: one small copy instead of several tiny tensor ops per step.)"""
    values = row_max.tolist()
    if not all(map(math.isfinite, values)):
        bad = sum(not math.isfinite(v) for v in values)
        raise NonFiniteLogitsError(f"the model produced non-finite logits for {bad} of {len(values)} sequences")


def _plain_greedy(row: SamplingRow) -> bool:
    p = row.params
    return (p.temperature < SAMPLING_EPS and not p.needs_logprobs and not p.needs_penalties
            and row.num_output_tokens >= p.min_tokens)


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _param(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """A per-row column [R, 1] of one parameter, broadcastable against [R, vocab]."""
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def _apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Forbid EOS and stop token ids (in place) while a row has fewer than min_tokens outputs."""
    vocab = logits.shape[1]
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i, row in enumerate(rows):
        p = row.params
        if row.num_output_tokens < p.min_tokens:
            ids = [t for t in chain(p.eos_token_ids, p.stop_token_ids) if t < vocab]
            row_idx += [i] * len(ids)
            tok_idx += ids
    if row_idx:
        logits[_index(row_idx, logits.device), _index(tok_idx, logits.device)] = -torch.inf


def _flat_positions(rows: list[int], token_lists: list[list[int]], vocab: int) -> np.ndarray:
    """Positions in the flattened [batch, vocab] logits of each (row, token) pair."""
    lengths = [len(t) for t in token_lists]
    tokens = np.fromiter(chain.from_iterable(token_lists), dtype=np.int64, count=sum(lengths))
    # An out-of-range id would silently land in the neighbouring row.
    assert tokens.size == 0 or (tokens.min() >= 0 and tokens.max() < vocab), "token id outside the vocab"
    return tokens + np.repeat(np.array(rows, dtype=np.int64) * vocab, lengths)


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Repetition, frequency and presence penalties, in place.

    Sparse: only the (row, token) pairs seen in a prompt or output are gathered and
    rewritten, so the cost follows the number of tokens, not batch * vocab.
    """
    picked = [i for i, r in enumerate(rows) if r.params.needs_penalties]
    if not picked:
        return
    device, vocab = logits.device, logits.shape[1]
    outputs = _flat_positions(picked, [rows[i].output_token_ids for i in picked], vocab)
    # Prompt tokens only matter for the repetition penalty.
    rep_rows = [i for i in picked if rows[i].params.repetition_penalty != 1.0]
    prompts = _flat_positions(rep_rows, [rows[i].prompt_token_ids for i in rep_rows], vocab)
    pairs = torch.from_numpy(np.concatenate([outputs, prompts])).to(device)
    positions, inverse = torch.unique(pairs, return_inverse=True)
    counts = torch.zeros(positions.numel(), dtype=logits.dtype, device=device)
    ones = torch.ones(len(outputs), dtype=logits.dtype, device=device)
    counts.index_add_(0, inverse[:len(outputs)], ones)
    row_of = positions // vocab

    def per_pair(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=logits.dtype, device=device)[row_of]

    flat = logits.view(-1)
    vals = flat[positions]
    # Every gathered pair was seen by its row; rows without a repetition penalty divide by 1.
    rp = per_pair([r.params.repetition_penalty for r in rows])
    vals = torch.where(vals > 0, vals / rp, vals * rp)
    vals -= per_pair([r.params.frequency_penalty for r in rows]) * counts
    vals -= per_pair([r.params.presence_penalty for r in rows]) * (counts > 0)
    flat[positions] = vals


def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    random = [i for i, r in enumerate(rows) if r.params.temperature >= SAMPLING_EPS]
    if not random:
        return logits.argmax(dim=-1)
    if len(random) == len(rows):
        return _sample_random(logits, rows)
    tokens = logits.argmax(dim=-1)
    idx = _index(random, logits.device)
    tokens[idx] = _sample_random(logits[idx], [rows[i] for i in random])
    return tokens


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Draw one token per row; every row here has a temperature above SAMPLING_EPS."""
    weights = _weights(logits, rows)
    u = torch.from_numpy(uniforms([r.seed for r in rows], [r.num_output_tokens for r in rows]))
    return _inverse_cdf(weights, u.to(weights.device), logits)


def _weights(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Each row's distribution after temperature, top-k, top-p and min-p, unnormalized (a fresh
    tensor); every row here has a temperature above SAMPLING_EPS."""
    params = [r.params for r in rows]
    scaled = logits / _param([p.temperature for p in params], logits)
    # Unnormalized probabilities with the row maximum at exactly 1: the filters below only
    # zero entries, and inverse-CDF sampling needs no normalization.
    weights = scaled.sub_(scaled.amax(dim=-1, keepdim=True)).exp_()
    vocab = weights.shape[1]
    with_k = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
    only_p = [i for i, p in enumerate(params) if p.top_p < 1.0 and not 0 < p.top_k < vocab]
    weights = _on_rows(weights, with_k, lambda w: _top_k_top_p(w, [params[i] for i in with_k]))
    weights = _on_rows(weights, only_p, lambda w: _top_p(w, [params[i].top_p for i in only_p]))
    if any(p.min_p > 0.0 for p in params):
        # prob < min_p * max_prob, with max_prob = 1 in these units (the top token survives all filters).
        weights.masked_fill_(weights < _param([p.min_p for p in params], weights), 0.0)
    return weights


def _subset(t: torch.Tensor, picked: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The picked rows (a copy), or the tensor itself with no index when all rows are picked."""
    if len(picked) == t.shape[0]:
        return t, None
    idx = _index(picked, t.device)
    return t[idx], idx


def _on_rows(weights: torch.Tensor, picked: list[int],
             fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """weights with the picked rows replaced by fn of them."""
    if not picked:
        return weights
    sub, idx = _subset(weights, picked)
    if idx is None:
        return fn(sub)
    weights[idx] = fn(sub)
    return weights


def _top_k_top_p(weights: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Top-k, then top-p on what is left: both only need each row's k largest weights."""
    k = _index([p.top_k for p in params], weights.device).unsqueeze(1)
    top, order = weights.topk(max(p.top_k for p in params), dim=-1, sorted=True)
    # Keep exactly the first k of each row's ranking, so ties at the boundary cannot add tokens.
    top.masked_fill_(torch.arange(top.shape[1], device=top.device) >= k, 0.0)
    if any(p.top_p < 1.0 for p in params):
        limit = _param([p.top_p if p.top_p < 1.0 else torch.inf for p in params], top)
        cum = top.cumsum(dim=-1)
        top.masked_fill_(_beyond_top_p(cum, top, limit * cum[:, -1:]), 0.0)
    return torch.zeros_like(weights).scatter_(1, order, top)


# Partial sorts tried before a full one: a row whose top-N already holds top_p of its mass
# has its whole top-p set inside those N, and real LM distributions rarely need more.
_TOP_P_CANDIDATES = (256, 4096)


def _top_p(weights: torch.Tensor, ps: list[float]) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p."""
    n, vocab = weights.shape
    limit = _param(ps, weights) * weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(weights)
    rows = torch.arange(n, device=weights.device)
    cand, lim = weights, limit
    for size in [c for c in _TOP_P_CANDIDATES if c < vocab] + [vocab]:
        partial = size < vocab
        top, order = cand.topk(size, dim=-1) if partial else cand.sort(dim=-1, descending=True)
        cum = top.cumsum(dim=-1)
        done = (cum[:, -1:] >= lim).squeeze(1) if partial else torch.ones_like(rows, dtype=torch.bool)
        # A token goes once the mass strictly before it already reaches top_p; the first never does.
        top.masked_fill_(_beyond_top_p(cum, top, lim), 0.0)
        # Write the finished rows' candidates into place; everything else stays zero.
        flat = (rows[done] * vocab).unsqueeze(1) + order[done]
        out.view(-1)[flat.view(-1)] = top[done].view(-1)
        rows, cand, lim = rows[~done], cand[~done], lim[~done]
        if rows.numel() == 0:
            break
    return out


def _beyond_top_p(cum: torch.Tensor, top: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """Sorted candidates to drop: the mass strictly before them already reaches the limit. The
    most likely token always stays, even when top_p * mass underflows to 0 (top_p = 1e-50)."""
    beyond = (cum - top) >= limit
    beyond[:, 0] = False
    return beyond


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The token whose CDF interval (in vocab order) holds u * total mass.

    A row left with no finite positive mass (which the parameter ranges are meant to rule out)
    takes its most likely token instead of the last id of the vocabulary.
    """
    cdf = weights.cumsum_(dim=-1)
    total = cdf[:, -1:]
    # u < 1, but u * total can round up to total; stay strictly below it so a token is found.
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)
    bad = ~((total > 0) & torch.isfinite(total)).squeeze(1)
    if bool(bad.any()):
        tokens[bad] = torch.nan_to_num(logits[bad], nan=-torch.inf).argmax(dim=-1)
    return tokens


_M64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer (uint64 arithmetic wraps, as intended)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def uniforms(seeds: list[int], steps: list[int]) -> np.ndarray:
    """One float32 uniform in [0, 1) per (seed, step), a pure function of that pair.

    This is what makes a seeded request reproducible whatever else shares its batch.
    """
    s = np.array([x & _M64 for x in seeds], dtype=np.uint64)
    t = np.array(steps, dtype=np.uint64)
    h = _mix64(_mix64(s + _GOLDEN) + (t + np.uint64(1)) * _GOLDEN)
    # 24 bits: exactly representable in float32, and the largest value stays below 1.
    return (h >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)


def _gather_logprobs(raw: torch.Tensor, rows: list[SamplingRow],
                     tokens: torch.Tensor) -> tuple[list[dict[int, float] | None], list[int | None]]:
    logprobs: list[dict[int, float] | None] = [None] * len(rows)
    ranks: list[int | None] = [None] * len(rows)
    picked = [i for i, r in enumerate(rows) if r.params.needs_logprobs]
    if not picked:
        return logprobs, ranks
    x, idx = _subset(raw, picked)
    entries, entry_ranks = logprob_entries(x, tokens if idx is None else tokens[idx],
                                           [rows[i].params.logprobs or 0 for i in picked])
    for j, i in enumerate(picked):
        logprobs[i], ranks[i] = entries[j], entry_ranks[j]
    return logprobs, ranks


def logprob_entries(x: torch.Tensor, targets: torch.Tensor,
                    ks: list[int]) -> tuple[list[dict[int, float]], list[int]]:
    """Per row of logits `x`: {token: logprob} for its top ks[row] tokens and its target token, and the
    target's rank. logprob = logit - logsumexp: ranks and top-N come from the logits, no [rows, vocab]
    log_softmax."""
    x = x.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    target = targets.unsqueeze(1)
    target_x = x.gather(1, target)
    rank = ((x > target_x).sum(dim=-1) + 1).tolist()
    top_x, top_ids = x.topk(max(ks), dim=-1)
    top_lp, top_ids = (top_x - lse).tolist(), top_ids.tolist()
    target_ids, target_lps = target.squeeze(1).tolist(), (target_x - lse).squeeze(1).tolist()
    entries = []
    for j, n in enumerate(ks):
        entry = dict(zip(top_ids[j][:n], top_lp[j][:n]))
        entry.setdefault(target_ids[j], target_lps[j])
        entries.append(entry)
    return entries, rank
