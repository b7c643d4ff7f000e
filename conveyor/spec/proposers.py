"""Draft proposers: cheap guesses of a request's next few tokens, which the model then verifies in one step.

``NgramProposer`` is prompt lookup decoding. The last n tokens of a request (its prompt and output so far)
often occurred earlier in it: code being edited, a document being quoted or summarised, a schema being
filled in. What followed them then is a good guess for what follows now. It takes the longest such n
(``max_n`` down to ``min_n``) and the most recent earlier occurrence, and proposes the up to k tokens that
came after it. A per-request index of the sequence's n-grams, extended by the tokens appended since the
last call, keeps a call at O(max_n + k) instead of a scan of the whole sequence.

``SuffixProposer`` also looks the request's last tokens up in the sequences of recently finished requests
(agent loops and templated traffic repeat across requests) and takes the longer of the two matches, its own
on a tie.
A request draws only on requests with its own ``cache_salt``, as with prefix-cache blocks, so one tenant's
text is never proposed (and its timing never observable) to another. The cache holds a bounded number of
sequences and tokens and forgets the oldest first, index entries included.

Both index n-grams in a trie of reversed n-grams: the path from a root through tokens t[e-1], t[e-2], ...,
t[e-n] reaches the node of the n-gram t[e-n:e], which holds where its most recent occurrence ended (the
start of its continuation). Adding an occurrence costs O(max_n) and a lookup of the longest match one walk
down from the root; a tuple-keyed dict per n would cost O(max_n^2) per token.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from conveyor.request import Request, RequestStatus


class Proposer(Protocol):
    name: str

    def propose(self, req: Request, k: int) -> list[int]:
        """Up to k draft tokens that would follow ``req.all_token_ids``; [] when there is no guess."""
        ...

    def finished(self, req: Request) -> None:
        """The request left the engine (finished, aborted or failed): drop its state."""
        ...


class _Trie:
    """Reversed n-grams (see the module docstring); a node's value says where its most recent occurrence
    ended. Node 0 is a root; ``new_root`` makes more (one per cache salt)."""

    __slots__ = ("edges", "value", "_next_node")

    def __init__(self) -> None:
        self.edges: dict[tuple[int, int], int] = {}   # (node, token) -> child
        self.value: dict[int, Any] = {}                # node -> its most recent occurrence
        self._next_node = 1

    def new_root(self) -> int:
        self._next_node += 1
        return self._next_node - 1

    def add(self, root: int, tokens: list[int], end: int, max_n: int, value: Any) -> None:
        """Record that the n-grams tokens[end-n:end], n = 1..max_n, occurred with this value (overwriting
        any earlier occurrence's)."""
        edges, node = self.edges, root
        for i in range(end - 1, max(end - max_n, 0) - 1, -1):
            key = (node, tokens[i])
            child = edges.get(key)
            if child is None:
                child = edges[key] = self._next_node
                self._next_node += 1
            self.value[child] = value
            node = child

    def longest(self, root: int, tokens: list[int], min_n: int, max_n: int) -> Any:
        """The value of the longest n-gram ending the tokens (n = max_n down to min_n) that has one; None if
        none has."""
        return self.match(root, tokens, min_n, max_n)[1]

    def match(self, root: int, tokens: list[int], min_n: int, max_n: int) -> tuple[int, Any]:
        """(n, value) of the longest n-gram ending the tokens that has a value; (0, None) if none has."""
        edges, node, found, length = self.edges, root, None, 0
        end = len(tokens)
        for n in range(1, min(max_n, end) + 1):
            node = edges.get((node, tokens[end - n]))
            if node is None:
                break
            if n >= min_n:
                found, length = self.value[node], n
        return length, found

    def remove(self, root: int, tokens: list[int], end: int, max_n: int, value: Any) -> None:
        """Delete the nodes of the n-grams ending at ``end`` whose most recent occurrence is this one.

        Called for every ``end`` of a sequence in increasing order, before anything newer than it is removed,
        this deletes exactly the n-grams that no other indexed sequence has, and never strands a node: an
        n-gram's longer extensions occur only where it does, so they last occurred at or before it and are
        removed before it or in the same walk (deepest first)."""
        edges, node, path = self.edges, root, []
        for i in range(end - 1, max(end - max_n, 0) - 1, -1):
            key = (node, tokens[i])
            node = edges.get(key)
            if node is None:
                break
            path.append((key, node))
        for key, node in reversed(path):
            if self.value[node] == value:
                del edges[key], self.value[node]


def _check_n(min_n: int, max_n: int) -> None:
    if min_n < 1:
        raise ValueError(f"min_n must be at least 1, got {min_n}")
    if max_n < min_n:
        raise ValueError(f"max_n must be at least min_n ({min_n}), got {max_n}")


@dataclass(slots=True, eq=False)
class _OwnIndex:
    """A request's ``spec_state``: its own n-grams, indexed up to (not including) the ones ending at ``indexed``."""
    trie: _Trie
    indexed: int = 1
    matched: int = 0   # the n of the latest proposal's match (0: none)


class NgramProposer:
    """Prompt lookup decoding over the request's own tokens (see the module docstring)."""

    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        _check_n(min_n, max_n)
        self.min_n, self.max_n = min_n, max_n

    def propose(self, req: Request, k: int) -> list[int]:
        if k <= 0:
            return []
        n, start = self.match(req)
        req.spec_state.matched = n
        return [] if start is None else req.all_token_ids[start:start + k]

    @staticmethod
    def match_length(req: Request) -> int:
        """The n-gram length of the request's latest proposal (its reliability: longer guesses better)."""
        state = req.spec_state
        return state.matched if isinstance(state, _OwnIndex) else 0

    def match(self, req: Request) -> tuple[int, int | None]:
        """(n, where its continuation starts) of the longest n-gram ending the request's tokens that
        occurred earlier in them; (0, None) if none did."""
        tokens = req.all_token_ids
        state = req.spec_state
        if not isinstance(state, _OwnIndex):
            state = req.spec_state = _OwnIndex(_Trie())
        assert state.indexed <= max(len(tokens), 1), "tokens were removed from a live request"
        # index the n-grams that gained a continuation since the last call: those ending before the last token
        for end in range(state.indexed, len(tokens)):
            state.trie.add(0, tokens, end, self.max_n, end)
        state.indexed = max(len(tokens), 1)
        return state.trie.match(0, tokens, self.min_n, self.max_n)

    def finished(self, req: Request) -> None:
        req.spec_state = None


@dataclass(slots=True, eq=False)
class _Cached:
    seq_id: int
    salt: str | None
    tokens: list[int]


class SuffixProposer:
    """The request's own n-grams first, then those of recently finished requests with the same cache salt
    (see the module docstring). At most ``max_cached_requests`` sequences and ``max_cached_tokens`` tokens
    are kept, over all salts; the oldest finished goes first, and a sequence longer than the whole token
    budget is not kept."""

    name = "suffix"

    def __init__(self, min_n: int = 1, max_n: int = 8, max_cached_requests: int = 256,
                 max_cached_tokens: int = 1 << 18) -> None:
        _check_n(min_n, max_n)
        if max_cached_requests < 0 or max_cached_tokens < 0:
            raise ValueError(f"the cache bounds must be non-negative, got max_cached_requests={max_cached_requests}, "
                             f"max_cached_tokens={max_cached_tokens}")
        self.min_n, self.max_n = min_n, max_n
        self.max_cached_requests, self.max_cached_tokens = max_cached_requests, max_cached_tokens
        self._own = NgramProposer(min_n, max_n)
        self._trie = _Trie()                       # node values: (seq_id, continuation start)
        self._roots: dict[str | None, int] = {}    # cache salt -> its trie root
        self._salt_counts: dict[str | None, int] = {}
        self._cached: deque[_Cached] = deque()     # oldest finished first
        self._tokens_of: dict[int, list[int]] = {}
        self._num_tokens = 0
        self._next_seq_id = 0

    def propose(self, req: Request, k: int) -> list[int]:
        """The longer of the two matches: the request's own tokens' and the cache's (a tie: its own)."""
        if k <= 0:
            return []
        n, start = self._own.match(req)
        req.spec_state.matched = n
        root = self._roots.get(req.cache_salt)
        if root is not None:
            n_cached, found = self._trie.match(root, req.all_token_ids, self.min_n, self.max_n)
            if found is not None and n_cached > n:
                seq_id, at = found
                req.spec_state.matched = n_cached
                return self._tokens_of[seq_id][at:at + k]
        return [] if start is None else req.all_token_ids[start:start + k]

    match_length = staticmethod(NgramProposer.match_length)

    def finished(self, req: Request) -> None:
        req.spec_state = None
        if req.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self._insert(req.cache_salt, list(req.all_token_ids))

    def stats(self) -> dict[str, int]:
        return {"cached_requests": len(self._cached), "cached_tokens": self._num_tokens,
                "index_entries": len(self._trie.edges)}

    def _insert(self, salt: str | None, tokens: list[int]) -> None:
        if len(tokens) < 2 or len(tokens) > self.max_cached_tokens or self.max_cached_requests == 0:
            return   # nothing with a continuation, or it cannot fit
        while self._cached and (len(self._cached) >= self.max_cached_requests
                                or self._num_tokens + len(tokens) > self.max_cached_tokens):
            self._evict_oldest()
        seq = _Cached(self._next_seq_id, salt, tokens)
        self._next_seq_id += 1
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = self._trie.new_root()
        for end in range(1, len(tokens)):
            self._trie.add(root, tokens, end, self.max_n, (seq.seq_id, end))
        self._cached.append(seq)
        self._tokens_of[seq.seq_id] = tokens
        self._salt_counts[salt] = self._salt_counts.get(salt, 0) + 1
        self._num_tokens += len(tokens)

    def _evict_oldest(self) -> None:
        seq = self._cached.popleft()
        root = self._roots[seq.salt]
        for end in range(1, len(seq.tokens)):
            self._trie.remove(root, seq.tokens, end, self.max_n, (seq.seq_id, end))
        del self._tokens_of[seq.seq_id]
        self._num_tokens -= len(seq.tokens)
        self._salt_counts[seq.salt] -= 1
        if not self._salt_counts[seq.salt]:   # the salt's last sequence: its nodes are all gone
            del self._salt_counts[seq.salt], self._roots[seq.salt]


_METHODS = {"ngram": NgramProposer, "suffix": SuffixProposer}


def make_proposer(method: str, **options: Any) -> Proposer:
    """The proposer named ``method`` ("ngram" or "suffix"), built with ``options``."""
    if method not in _METHODS:
        raise ValueError(f"unknown speculative decoding method {method!r}; accepted: {', '.join(_METHODS)}")
    return _METHODS[method](**options)
