"""Draft proposers (conveyor/spec/proposers.py) against brute-force references: the n-gram lookup on a
request's own tokens, incrementally and from scratch; the cross-request cache, its salts and its bounds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.request import Request, RequestStatus
from conveyor.sampling.params import SamplingParams
from conveyor.spec.proposers import NgramProposer, SuffixProposer, make_proposer

tokens_st = st.lists(st.integers(0, 3), max_size=40)
salt_st = st.sampled_from([None, "", "a", "b"])


def make_request(prompt: list[int], salt: str | None = None, rid: str = "r1") -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=100), cache_salt=salt)


def finish(proposer, tokens: list[int], salt: str | None = None,
           status: RequestStatus = RequestStatus.FINISHED_STOPPED) -> None:
    req = make_request(tokens, salt)
    req.finish(status, now=0.0)
    proposer.finished(req)


def ref_matches(seq: list[int], suffix: list[int], k: int) -> list[int] | None:
    """The continuation of the most recent occurrence of suffix in seq that has one, or None."""
    n = len(suffix)
    for i in range(len(seq) - n - 1, -1, -1):
        if seq[i:i + n] == suffix:
            return seq[i + n:i + n + k]
    return None


def ref_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    return ref_ngram_match(tokens, k, min_n, max_n)[1]


def ref_ngram_match(tokens: list[int], k: int, min_n: int, max_n: int) -> tuple[int, list[int]]:
    """(n, proposal) of the longest match in the request's own tokens; (0, []) if none."""
    if k <= 0:
        return 0, []
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        found = ref_matches(tokens, tokens[len(tokens) - n:], k)
        if found is not None:
            return n, found
    return 0, []


def ref_cross(cached: list[tuple[str | None, list[int]]], salt: str | None, tokens: list[int], k: int,
              min_n: int, max_n: int) -> tuple[int, list[int]]:
    """Longest suffix first; among the sequences of the same salt, the most recently finished first."""
    if k <= 0:
        return 0, []
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        for s, seq in reversed(cached):
            if s == salt and (found := ref_matches(seq, tokens[len(tokens) - n:], k)) is not None:
                return n, found
    return 0, []


n_range_st = st.tuples(st.integers(1, 4), st.integers(0, 4)).map(lambda t: (t[0], t[0] + t[1]))


@settings(max_examples=150, deadline=None)
@given(tokens=tokens_st, split=st.integers(0, 40), n_range=n_range_st, ks=st.lists(st.integers(0, 6), min_size=1))
def test_ngram_matches_the_reference_incrementally_and_from_scratch(tokens, split, n_range, ks):
    min_n, max_n = n_range
    proposer = NgramProposer(min_n, max_n)
    split = min(split, len(tokens))
    req = make_request(tokens[:split])
    for step in range(split, len(tokens) + 1):
        k = ks[step % len(ks)]
        want = ref_ngram(req.all_token_ids, k, min_n, max_n)
        assert proposer.propose(req, k) == want
        assert proposer.propose(make_request(req.all_token_ids), k) == want   # a fresh request: from scratch
        if step < len(tokens):
            req.append_token(tokens[step], now=0.0)


@settings(max_examples=100, deadline=None)
@given(tokens=tokens_st, k=st.integers(-1, 6))
def test_proposals_are_never_longer_than_k(tokens, k):
    suffix = SuffixProposer()
    finish(suffix, tokens[::-1] + tokens)   # something for the cross-request lookup to find
    for proposer in (NgramProposer(), suffix):
        draft = proposer.propose(make_request(tokens), k)
        assert len(draft) <= max(k, 0)
        if k <= 0:
            assert draft == []


def test_a_repeated_phrase_is_proposed_from_its_most_recent_occurrence():
    p = NgramProposer(min_n=1, max_n=3)
    # "1 2" occurs twice before the end; the later one (followed by 7 8) wins; the longest match (2 n-gram) wins
    req = make_request([1, 2, 5, 6, 9, 1, 2, 7, 8, 0, 3, 1, 2])
    assert p.propose(req, 2) == [7, 8]
    assert p.propose(req, 10) == [7, 8, 0, 3, 1, 2]   # up to k, fewer where the sequence ends
    assert p.propose(make_request([4, 5, 6]), 3) == []   # nothing repeats
    assert p.propose(make_request([]), 3) == []
    assert NgramProposer(min_n=2).propose(make_request([1, 2, 1]), 3) == []   # only a 1-gram repeats


class CountingList(list):
    """Counts the element reads of a list (a slice counts as one read per element it returns)."""

    def __init__(self, items):
        super().__init__(items)
        self.reads = 0

    def __getitem__(self, i):
        got = super().__getitem__(i)
        self.reads += len(got) if isinstance(i, slice) else 1
        return got


@pytest.mark.parametrize("proposer", [NgramProposer(1, 4), SuffixProposer(1, 4)], ids=["ngram", "suffix"])
def test_a_call_after_one_appended_token_reads_O_max_n_plus_k_tokens(proposer):
    req = make_request([i % 7 for i in range(5000)])   # periodic: every call finds a match
    req.all_token_ids = CountingList(req.all_token_ids)
    proposer.propose(req, 4)   # indexes the prompt once
    for t in range(200):
        req.all_token_ids.reads = 0
        req.append_token((5000 + t) % 7, now=0.0)
        assert proposer.propose(req, 4) == [(5001 + t + i) % 7 for i in range(4)]
        assert req.all_token_ids.reads <= 4 + 4 + 4   # index the new n-grams, look up the suffix, slice k
    proposer.finished(req)
    assert req.spec_state is None


def test_the_suffix_proposer_takes_the_longer_match_its_own_on_a_tie():
    p = SuffixProposer(max_n=4)
    finish(p, [1, 2, 3, 9, 9, 9])
    req = make_request([1, 2, 3, 4, 5, 1, 2, 3])
    assert p.propose(req, 3) == [4, 5, 1]   # a tie (3 tokens each): the request's own match
    assert p.match_length(req) == 3
    assert p.propose(make_request([7, 1, 2, 3]), 3) == [9, 9, 9]   # nothing of its own: the cache
    req = make_request([3, 8, 2, 1, 2, 3])   # its own match is "3" (1 token), the cache's "1 2 3"
    assert p.propose(req, 2) == [9, 9] and p.match_length(req) == 3


def test_cross_request_proposals_stay_within_a_cache_salt():
    p = SuffixProposer()
    finish(p, [10, 11, 12, 13, 14], salt="tenant-a")
    finish(p, [10, 11, 20, 21], salt=None)
    assert p.propose(make_request([5, 10, 11], salt="tenant-a"), 3) == [12, 13, 14]
    assert p.propose(make_request([5, 10, 11], salt=None), 3) == [20, 21]
    assert p.propose(make_request([5, 10, 11], salt="tenant-b"), 3) == []
    assert p.propose(make_request([5, 10, 11], salt=""), 3) == []   # "" is a salt of its own, not None


def test_only_normally_finished_requests_are_cached():
    p = SuffixProposer()
    for status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
        finish(p, [1, 2, 3], status=status)
    assert p.stats()["cached_requests"] == 0
    finish(p, [1, 2, 3], status=RequestStatus.FINISHED_LENGTH)
    assert p.stats() == {"cached_requests": 1, "cached_tokens": 3, "index_entries": p.stats()["index_entries"]}
    assert p.propose(make_request([1]), 5) == [2, 3]


def test_the_most_recently_finished_sequence_wins():
    p = SuffixProposer()
    finish(p, [1, 2, 3])
    finish(p, [1, 2, 4])
    assert p.propose(make_request([0, 1, 2]), 1) == [4]
    finish(p, [0, 1, 2, 5], salt="other")
    assert p.propose(make_request([0, 1, 2]), 1) == [4]


def test_evicted_sequences_are_never_proposed():
    p = SuffixProposer(max_cached_requests=2)
    finish(p, [1, 2, 3])
    finish(p, [4, 5, 6])
    finish(p, [7, 8, 9])   # evicts [1, 2, 3]
    assert p.propose(make_request([1]), 2) == []
    assert p.propose(make_request([4]), 2) == [5, 6]
    p = SuffixProposer(max_cached_tokens=7)
    finish(p, [1, 2, 3])
    finish(p, [4, 5, 6])
    finish(p, [7, 8])   # 8 tokens: evicts [1, 2, 3]
    assert p.stats()["cached_tokens"] == 5
    assert p.propose(make_request([1]), 2) == []
    finish(p, list(range(8)))   # longer than the whole budget: not kept, nothing evicted
    assert p.stats()["cached_tokens"] == 5


def test_the_index_stays_bounded_over_many_insert_evict_cycles():
    import random
    rng = random.Random(0)
    max_n = 5
    p = SuffixProposer(max_n=max_n, max_cached_requests=8, max_cached_tokens=300)
    for _ in range(400):
        finish(p, [rng.randrange(6) for _ in range(rng.randrange(2, 80))], salt=rng.choice([None, "a", "b"]))
        s = p.stats()
        assert s["cached_requests"] <= 8 and s["cached_tokens"] <= 300
        assert s["index_entries"] <= s["cached_tokens"] * max_n
        assert len(p._trie.value) == s["index_entries"]   # no node without its edge, nor the reverse


finish_op = st.tuples(st.just("finish"), salt_st, st.lists(st.integers(0, 3), max_size=12))
query_op = st.tuples(st.just("query"), salt_st, st.lists(st.integers(0, 3), max_size=8), st.integers(0, 5))


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.one_of(finish_op, query_op), max_size=30), n_range=n_range_st,
       max_requests=st.integers(0, 5), max_tokens=st.integers(0, 30))
def test_suffix_matches_the_reference(ops, n_range, max_requests, max_tokens):
    min_n, max_n = n_range
    p = SuffixProposer(min_n, max_n, max_cached_requests=max_requests, max_cached_tokens=max_tokens)
    cached: list[tuple[str | None, list[int]]] = []   # the reference cache, oldest first
    for op in ops:
        if op[0] == "finish":
            _, salt, tokens = op
            finish(p, tokens, salt)
            if 2 <= len(tokens) <= max_tokens and max_requests:
                while cached and (len(cached) >= max_requests
                                  or sum(len(t) for _, t in cached) + len(tokens) > max_tokens):
                    cached.pop(0)
                cached.append((salt, tokens))
        else:
            _, salt, tokens, k = op
            own, other = ref_ngram_match(tokens, k, min_n, max_n), ref_cross(cached, salt, tokens, k, min_n, max_n)
            want = other[1] if other[0] > own[0] else own[1]   # the longer match; its own on a tie
            assert p.propose(make_request(tokens, salt), k) == want
        s = p.stats()
        assert (s["cached_requests"], s["cached_tokens"]) == (len(cached), sum(len(t) for _, t in cached))
        assert s["index_entries"] <= s["cached_tokens"] * max_n
    while p._cached:   # emptied, the cache leaves no index entry and no root behind
        p._evict_oldest()
    assert p._trie.edges == {} and p._trie.value == {} and p._roots == {}


def test_make_proposer_and_validation():
    assert make_proposer("ngram", max_n=3).name == "ngram"
    s = make_proposer("suffix", min_n=2, max_cached_requests=4)
    assert s.name == "suffix" and (s.min_n, s.max_cached_requests) == (2, 4)
    with pytest.raises(ValueError, match="ngram, suffix"):
        make_proposer("eagle")
    for bad in ({"min_n": 0}, {"min_n": 3, "max_n": 2}):
        with pytest.raises(ValueError):
            NgramProposer(**bad)
        with pytest.raises(ValueError):
            SuffixProposer(**bad)
    with pytest.raises(ValueError):
        SuffixProposer(max_cached_tokens=-1)
