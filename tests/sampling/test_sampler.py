import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.sampling.params import SamplingParams
from conveyor.sampling.sampler import (NonFiniteLogitsError, Sampler, SamplingRow, _apply_penalties, _inverse_cdf, _top_p,
                                       uniforms)

sample = Sampler()


def row(seed: int = 0, out: list[int] | None = None, prompt: list[int] | None = None, **kw) -> SamplingRow:
    """A row as the scheduler builds it: the history only goes along when a penalty needs it."""
    params = SamplingParams(**kw)
    out = out or []
    r = SamplingRow(params, seed, len(out))
    if params.needs_penalties:
        r.output_token_ids = list(out)
        r.prompt_token_ids = list(prompt or [1, 2]) if params.repetition_penalty != 1.0 else None
    return r


def draws(logits: list[float], n: int, **kw) -> np.ndarray:
    """n samples of one distribution, each with its own (seed, step)."""
    rows = [row(seed=i // 8, out=[0] * (i % 8), **kw) for i in range(n)]
    return np.array(sample(torch.tensor([logits]).expand(n, -1), rows).token_ids)


def test_greedy_fast_path_is_argmax():
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(0))
    out = sample(logits, [row(temperature=0.0) for _ in range(16)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 16 and out.ranks == [None] * 16


def test_greedy_rows_in_a_mixed_batch_take_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    rows = [row(temperature=0.0) if i % 2 else row(seed=i, top_p=0.5) for i in range(6)]
    assert sample(logits, rows).token_ids[1::2] == logits[1::2].argmax(-1).tolist()


def test_tiny_temperature_equals_greedy():
    g = torch.Generator().manual_seed(2)
    # Distinct logits 0.1 apart: at T=2e-5 the runner-up weighs exp(-5000).
    logits = torch.stack([torch.randperm(500, generator=g).float() * 0.1 for _ in range(64)])
    rows = [row(seed=i, temperature=2e-5) for i in range(64)]
    assert sample(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_top_k_never_leaves_the_top_k():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2000, 40, generator=g) * 0.3  # flat-ish, so the tail would often win
    ks = [i % 8 for i in range(2000)]  # mixed k in one batch, 0 meaning no top-k
    tokens = torch.tensor(sample(logits, [row(seed=i, top_k=k) for i, k in enumerate(ks)]).token_ids)
    ranks = (logits > logits.gather(1, tokens[:, None])).sum(-1)
    for k, rank in zip(ks, ranks.tolist()):
        assert k == 0 or rank < k
    assert max(r for k, r in zip(ks, ranks.tolist()) if k == 0) >= 8  # the unfiltered rows do roam


def test_top_k_with_tied_logits_keeps_exactly_k_tokens():
    tokens = draws([0.0] * 10, 1000, top_k=3)
    assert len(set(tokens.tolist())) == 3


@pytest.mark.parametrize("kw, support", [
    (dict(top_p=0.4), {0}),
    (dict(top_p=0.75), {0, 1}),
    (dict(top_p=0.85), {0, 1, 2}),
    (dict(top_p=0.99), {0, 1, 2, 3}),
    (dict(min_p=0.2), {0, 1, 2}),   # threshold 0.1
    (dict(min_p=0.5), {0, 1}),      # threshold 0.25
    (dict(top_k=3, top_p=0.82), {0, 1}),  # top-p renormalizes after top-k: 0.8/0.95 >= 0.82
    (dict(top_p=0.85, min_p=0.5), {0, 1}),
])
def test_support_sets(kw, support):
    logits = np.log([0.5, 0.3, 0.15, 0.05]).tolist()
    assert set(draws(logits, 3000, **kw).tolist()) == support


def test_top_p_partial_sorts_match_a_full_sort():
    g = torch.Generator().manual_seed(7)
    scales = torch.logspace(1, -2.5, 24)  # peaked rows stop at the first partial sort, flat ones need all
    logits = torch.randn(24, 6000, generator=g) * scales[:, None]
    weights = (logits - logits.amax(-1, keepdim=True)).exp()
    ps = [0.3, 0.9, 0.97] * 8
    got = _top_p(weights, ps)
    top, order = weights.sort(dim=-1, descending=True, stable=True)
    cum = top.cumsum(-1)
    keep_sorted = (cum - top) < torch.tensor(ps)[:, None] * weights.sum(-1, keepdim=True)
    want = torch.zeros_like(weights, dtype=torch.bool).scatter_(1, order, keep_sorted)
    assert torch.equal(got > 0, want)
    assert torch.equal(got[want], weights[want])
    sizes = want.sum(-1)
    assert sizes.min() <= 256 and ((sizes > 256) & (sizes <= 4096)).any() and sizes.max() > 4096


@given(
    logits=st.lists(st.floats(-5, 5), min_size=2, max_size=12),
    temperature=st.floats(0.05, 3.0),
    top_k=st.integers(0, 12),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 0.9),
    seed=st.integers(-(2**63), 2**64),
)
@settings(max_examples=150, deadline=None)
def test_sampled_token_passes_every_filter(logits, temperature, top_k, top_p, min_p, seed):
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    n = 16
    rows = [row(seed=seed, out=[0] * i, **kw) for i in range(n)]
    tokens = sample(torch.tensor([logits]).expand(n, -1), rows).token_ids
    x = np.array(logits, dtype=np.float64) / np.float32(temperature)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    k = top_k if 0 < top_k < len(logits) else len(logits)
    tol = 1e-4
    for t in tokens:
        assert probs[t] >= probs[order[k - 1]] - tol, "outside the top k"
        kept = probs[order[:k]]
        assert kept[kept > probs[t] + tol].sum() / kept.sum() < top_p + tol, "outside the top-p set"
        assert probs[t] >= min_p * probs.max() - tol, "below min_p"


@pytest.mark.parametrize("kw", [
    dict(temperature=0.7),
    dict(temperature=1.0),
    dict(temperature=1.5, top_k=3),
    dict(temperature=1.0, top_p=0.9),
])
def test_empirical_distribution_matches_softmax(kw):
    logits = np.array([1.0, 0.5, 0.0, -0.5, -2.0])
    n = 20_000
    p = np.exp(logits / kw["temperature"])
    p /= p.sum()
    if "top_k" in kw:
        p[np.argsort(-p)[kw["top_k"]:]] = 0
    if "top_p" in kw:
        order = np.argsort(-p)
        p[order[(np.cumsum(p[order]) - p[order]) >= kw["top_p"]]] = 0
    p /= p.sum()
    counts = np.bincount(draws(logits.tolist(), n, **kw), minlength=5)
    assert (counts[p == 0] == 0).all()
    expected = n * p[p > 0]
    chi2 = (((counts[p > 0] - expected) ** 2) / expected).sum()
    assert chi2 < 30, (chi2, counts, expected)  # 4 dof: p ~ 1e-5


def _other_rows(rng: np.random.Generator, n: int) -> list[SamplingRow]:
    kinds = [dict(temperature=0.0), dict(temperature=1.3, top_k=7), dict(top_p=0.5),
             dict(min_p=0.1, presence_penalty=1.0), dict(repetition_penalty=1.5, logprobs=2)]
    return [row(seed=int(rng.integers(1 << 30)), out=rng.integers(0, 200, 4).tolist(), **kinds[i % 5])
            for i in range(n)]


def test_same_seed_same_token_whatever_the_batch():
    rng = np.random.default_rng(4)
    g = torch.Generator().manual_seed(4)
    kw = dict(temperature=0.9, top_p=0.95, top_k=100, min_p=0.01, frequency_penalty=0.3)
    for seed in range(25):
        me = row(seed=seed, out=rng.integers(0, 200, seed % 6).tolist(), **kw)
        mine = torch.randn(1, 200, generator=g)
        alone = sample(mine, [me]).token_ids[0]
        for pos in (0, 3, 7):
            others = _other_rows(rng, 7)
            logits = torch.randn(8, 200, generator=g)
            logits[pos] = mine[0]
            batch = others[:pos] + [me] + others[pos:]
            assert sample(logits, batch).token_ids[pos] == alone


def test_draw_depends_on_seed_and_step():
    logits = torch.zeros(300, 1000)
    by_seed = sample(logits, [row(seed=s) for s in range(300)]).token_ids
    by_step = sample(logits, [row(seed=9, out=[0] * s) for s in range(300)]).token_ids
    assert len(set(by_seed)) > 200 and len(set(by_step)) > 200
    assert sample(logits, [row(seed=s) for s in range(300)]).token_ids == by_seed


def test_uniforms_are_a_pure_function_of_seed_and_step():
    u = uniforms(list(range(10_000)), [3] * 10_000)
    assert u.dtype == np.float32 and (u >= 0).all() and (u < 1).all()
    assert abs(u.mean() - 0.5) < 0.01
    assert (uniforms([5, -1, 2**70], [0, 1, 2]) == uniforms([5, -1, 2**70], [0, 1, 2])).all()
    assert uniforms([5], [0])[0] == uniforms([7, 5], [0, 0])[1]


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]]).repeat(3, 1)
    rows = [row(prompt=[0, 4], out=[2, 2, 4], repetition_penalty=2.0, frequency_penalty=0.5,
                presence_penalty=0.25),
            row(prompt=[0, 4], out=[2, 2, 4]),
            row(prompt=[3], out=[1, 1], frequency_penalty=1.0)]
    original = logits.clone()
    got = logits.clone()
    _apply_penalties(got, rows)  # in place
    # Repetition on {0, 2, 4} (prompt or output): 2/2, 0.5/2, -2*2. Then for output counts
    # {2: 2, 4: 1}: token 2 -> 0.25 - 0.5*2 - 0.25, token 4 -> -4 - 0.5*1 - 0.25.
    assert got[0].tolist() == [1.0, -1.0, -1.0, 3.0, -4.75, 1.0]
    assert got[1].tolist() == original[1].tolist()
    assert got[2].tolist() == [2.0, -3.0, 0.5, 3.0, -2.0, 1.0]  # prompt-only token 3 untouched


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[0.0, 1.0, 1.2]])
    assert sample(logits, [row(out=[2], temperature=0.0)]).token_ids == [2]
    assert sample(logits, [row(out=[2], temperature=0.0, presence_penalty=0.5)]).token_ids == [1]
    assert sample(logits, [row(prompt=[2], temperature=0.0, repetition_penalty=1.5)]).token_ids == [1]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 2.0, 1.0, 3.0]])  # eos 3 best, stop id 1 next
    kw = dict(min_tokens=2, eos_token_ids=(3,), stop_token_ids=[1], temperature=0.0)
    assert sample(logits, [row(out=[0], **kw)]).token_ids == [2]
    assert sample(logits, [row(out=[0, 0], **kw)]).token_ids == [3]
    assert sample(logits, [row(out=[0], ignore_eos=True, **kw)]).token_ids == [2]
    kw["temperature"] = 1.0
    tokens = sample(logits.expand(500, -1), [row(seed=i, out=[0], **kw) for i in range(500)]).token_ids
    assert set(tokens) == {0, 2}


def test_logprobs_are_raw_top_n_plus_sampled():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(40, 100, generator=g)
    rows = [row(seed=i, out=[7, 8], logprobs=[0, 1, 3, None][i % 4], presence_penalty=0.5,
                temperature=[0.0, 2.0][i % 2], top_k=[0, 20][i % 3 // 2]) for i in range(40)]
    out = sample(logits, rows)
    ref = torch.log_softmax(logits.double(), -1)
    for i, (r, tok, lp, rank) in enumerate(zip(rows, out.token_ids, out.logprobs, out.ranks)):
        n = r.params.logprobs
        if n is None:
            assert lp is None and rank is None
            continue
        top = ref[i].topk(n).indices.tolist()
        assert list(lp)[:n] == top and set(lp) == set(top) | {tok}
        for t, v in lp.items():
            assert v == pytest.approx(ref[i, t].item(), abs=1e-5)
        assert rank == int((ref[i] > ref[i, tok]).sum()) + 1


def test_input_logits_are_not_modified():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(6))
    original = logits.clone()
    rows = [row(seed=1, out=[1, 2], min_tokens=5, eos_token_ids=(0,), repetition_penalty=1.3, top_p=0.8),
            row(seed=2, top_k=4, min_p=0.1), row(temperature=0.0, out=[3], frequency_penalty=1.0),
            row(seed=3, logprobs=2)]
    sample(logits, rows)
    assert torch.equal(logits, original)


# ---- robustness: non-finite logits, underflowing top_p, rows with no mass ---------------------

@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=0.7, seed=1), dict(temperature=0.0, logprobs=2)])
def test_nan_or_infinite_logits_raise_a_clear_error(kw):
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3))
    logits[1, 5] = float("nan")
    with pytest.raises(NonFiniteLogitsError, match="1 of 3"):
        sample(logits, [row(**kw) for _ in range(3)])
    logits[1, 5], logits[2] = 0.0, -torch.inf
    with pytest.raises(NonFiniteLogitsError):
        sample(logits, [row(**kw) for _ in range(3)])


def test_top_p_underflowing_to_zero_keeps_the_most_likely_token():
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(4))
    for kw in (dict(top_p=1e-50), dict(top_p=1e-50, top_k=20)):
        out = sample(logits, [row(seed=i, temperature=1.0, **kw) for i in range(8)])
        assert out.token_ids == logits.argmax(-1).tolist()


def test_a_row_with_no_mass_takes_its_most_likely_token():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    weights = torch.tensor([[0.0, 0.0, 0.0], [float("nan")] * 3])
    assert _inverse_cdf(weights, torch.tensor([0.5, 0.5]), logits).tolist() == [1, 0]
