"""Speculative verification is lossless: whatever the draft, the emitted token is the one the sampler
draws without speculation (so it has exactly the distribution the sampler draws from: temperature,
top-k, top-p, min-p; checked with a chi-square test over many seeds), and a draft is accepted with
probability p(draft); greedy rows accept exactly the argmax."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conveyor.sampling.params import SamplingParams
from conveyor.sampling.row import SamplingRow
from conveyor.sampling.sampler import Sampler, _weights



def chi_square_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's test: P(chi2 with len - 1 degrees of freedom >= the statistic)."""
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))

VOCAB = 8
LOGITS = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])


def rows_for(params: SamplingParams, seeds: range, position: int = 3) -> list[SamplingRow]:
    return [SamplingRow(params, seed, position) for seed in seeds]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.1),
])
@pytest.mark.parametrize("draft", [0, 3, 7])   # the likeliest token, a middling one, one outside top-k/p
def test_emitted_token_has_the_target_distribution(params, draft):
    n = 20000
    rows = rows_for(params, range(n))
    logits = LOGITS.expand(n, VOCAB).contiguous()
    out = Sampler().verify(logits, rows, [draft] * n)
    counts = np.bincount(out.emitted, minlength=VOCAB)
    w = _weights(LOGITS.clone(), rows[:1])[0]
    p = (w / w.sum()).numpy().astype(np.float64)
    support = p > 0
    assert counts[~support].sum() == 0   # never a token the filters removed, draft or not
    expected = p[support] / p[support].sum() * counts.sum()
    pvalue = chi_square_pvalue(counts[support], expected)
    assert pvalue > 1e-4, (counts, expected)
    # accepted exactly when the draft is emitted, with probability p(draft)
    assert all(a == (e == draft) for a, e in zip(out.accepted, out.emitted))
    assert sum(out.accepted) / n == pytest.approx(p[draft], abs=4 * (p[draft] * (1 - p[draft]) / n) ** 0.5 + 1e-9)


def test_greedy_rows_accept_exactly_the_argmax():
    rows = rows_for(SamplingParams(temperature=0), range(VOCAB))
    logits = LOGITS.expand(VOCAB, VOCAB).contiguous()
    out = Sampler().verify(logits, rows, list(range(VOCAB)))
    assert out.accepted == [d == 0 for d in range(VOCAB)]
    assert out.emitted == [0] * VOCAB


def test_rows_emit_what_the_plain_sampler_draws_whatever_the_drafts():
    """A seeded row emits the token Sampler() draws at its position, drafted or not: seeded outputs do
    not depend on speculation."""
    params = SamplingParams(temperature=0.9, top_p=0.95)
    rows = rows_for(params, range(200), position=5)
    logits = torch.randn(200, VOCAB, generator=torch.Generator().manual_seed(0))
    plain = Sampler()(logits.clone(), rows).token_ids
    for drafts in ([-1] * 200, [i % VOCAB for i in range(200)], plain):
        out = Sampler().verify(logits.clone(), rows, drafts)
        assert out.emitted == plain
        assert out.accepted == [d == t for d, t in zip(drafts, plain)]


def test_min_tokens_holds_at_every_position():
    """A draft of EOS before min_tokens is refused at the positions that forbid it."""
    params = SamplingParams(temperature=0, min_tokens=2)
    params.eos_token_ids = [0]
    rows = [SamplingRow(params, 1, j) for j in range(3)]   # positions 0, 1, 2
    logits = LOGITS.expand(3, VOCAB).contiguous()
    out = Sampler().verify(logits, rows, [0, 0, 0])
    assert out.accepted == [False, False, True]
    assert out.emitted[:2] == [1, 1]
