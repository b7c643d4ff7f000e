"""Speculative decoding's side of the scheduler: which requests propose tokens this step, and how many.

Each step the scheduler asks the speculator for the drafts of its running decodes before it
schedules them. A draft is up to ``num_speculative_tokens`` tokens from the proposer (proposers.py);
the scheduler schedules it as extra query tokens of its request (they count against the step's
token budget and take KV slots), the runner verifies them in the same forward pass as everyone
else's work, and ``observe`` learns how many were accepted.

How many, by cost: a step of T tokens (its decodes and prefill chunks) costs C(T) and does T tokens
of work. The j-th draft of a request whose drafts are accepted with probability a is worth a**j
expected tokens (it counts only if the j - 1 before it were accepted). Candidates sorted best first,
the step takes the prefix of them with the most expected work per second, (T + gain) / C(T + drafts)
(the best prefix, not the first that stops improving: C need not be convex), if it beats none by
3% (the costs and rates are estimates). At batch 1 on a CPU,
where the step reads every weight once whatever its rows, several drafts cost little; with a large
batch the step is compute-bound, an extra row costs about as much as a whole decode, and speculation
turns itself off. C comes from the decode-step times this engine measured (per token-count bucket,
scaled along the cost model's curve within one; a bucket not measured lately is priced from the
current step's, along the curve), else from the profile's (or the default) step-cost curve scaled
to the measured ones. Each
request's acceptance rate is its own record, shrunk toward the proposer's overall rate; a request
that stopped speculating tries a single draft now and then (after 16 steps, the wait doubling after
each probe that did not lead to more, up to 512), so a rate can recover.

No torch here: the simulator drives the same class (its executor draws acceptances).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from conveyor.request import Request
from conveyor.scheduler.costs import StepCostModel
from conveyor.spec.proposers import Proposer, make_proposer

METHODS = ("ngram", "suffix")


@dataclass(slots=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config`` names where vLLM has the knob."""

    method: str = "ngram"                 # ngram (prompt lookup) | suffix (also recent outputs of other requests)
    num_speculative_tokens: int = 5       # most drafts per request and step
    prompt_lookup_min: int = 1            # shortest n-gram matched
    prompt_lookup_max: int = 4            # longest n-gram matched (suffix: up to 8 by default)
    adaptive: bool = True                 # the cost model picks each step's drafts; False: every match, up to the max
    suffix_cache_requests: int = 256      # suffix: finished requests whose tokens are kept for lookups
    suffix_cache_tokens: int = 1 << 18    # suffix: ... and at most this many tokens of them in all

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r}: expected one of {', '.join(METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError("num_speculative_tokens must be in 1..32")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From a JSON object (the CLI's --speculative-config) or a dict (offline); None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative config key(s) {unknown}; known: {sorted(known)}")
        return cls(**value)

    def proposer(self) -> Proposer:
        if self.method == "ngram":
            return make_proposer("ngram", min_n=self.prompt_lookup_min, max_n=self.prompt_lookup_max)
        return make_proposer("suffix", min_n=self.prompt_lookup_min, max_n=max(self.prompt_lookup_max, 8),
                             max_cached_requests=self.suffix_cache_requests,
                             max_cached_tokens=self.suffix_cache_tokens)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class SpecStats:
    """vLLM's spec-decode counters: verifications with drafts, draft tokens, accepted ones, and the
    accepted ones by position (index j: drafts accepted at position j + 1)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


def _bucket(tokens: int) -> int:
    """Step sizes measured together: exact up to 8, then four per doubling."""
    if tokens <= 8:
        return tokens
    e = tokens.bit_length() - 3
    return (tokens >> e) << e


class StepTimes:
    """Seconds per decode step by its token count, learned from this engine's own steps.

    Each token-count bucket keeps the average ratio of its measured steps' times to the cost model's
    curve at their sizes, so a size within a bucket is priced along the curve. A bucket measured long ago (more than ``stale`` steps back) describes
    other contexts, another batch: a size priced against the current step's is then taken from the
    current step's bucket scaled along the curve. Never measured: the curve times the median
    measured/model ratio."""

    def __init__(self, model: StepCostModel, weight: float = 0.1, stale: int = 64):
        self.model = model
        self.weight = weight
        self.stale = stale
        self.measured: dict[int, float] = {}   # bucket -> measured / model
        self._when: dict[int, int] = {}
        self._steps = 0
        self._ratio: float | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not seconds > 0:
            return
        b = _bucket(tokens)
        old = self.measured.get(b)
        ratio = seconds / self.model.token_cost(tokens)
        self._steps += 1
        if old is None or self._steps - self._when[b] > self.stale:
            self.measured[b] = ratio   # (a stale average is forgotten, not blended in)
        else:
            self.measured[b] = old + self.weight * (ratio - old)
        self._when[b] = self._steps
        self._ratio = None

    def ratio(self) -> float:
        if self._ratio is None:
            r = sorted(self.measured.values())
            self._ratio = r[len(r) // 2] if r else 1.0
        return self._ratio

    def _along_curve(self, bucket: int, tokens: int) -> float:
        return self.measured[bucket] * self.model.token_cost(tokens)

    def __call__(self, tokens: int, against: int | None = None) -> float:
        """A step of `tokens`; `against`: the size it is compared with (the step as planned)."""
        b = _bucket(tokens)
        if b in self.measured and (against is None or self._steps - self._when[b] <= self.stale):
            return self._along_curve(b, tokens)
        a = None if against is None else _bucket(against)
        if a in self.measured:
            return self._along_curve(a, tokens)
        return self.model.token_cost(tokens) * self.ratio()


class Speculator:
    """Drafts per step for the scheduler (see the module docstring)."""

    PRIOR_WEIGHT = 8.0     # the proposer's overall rate counts as this many drafts of a request's own
    PROBE_EVERY = 16       # a request not speculating tries one draft after this many steps ...
    PROBE_MAX = 512        # ... the wait doubling after each probe that is not taken up, to at most this
    MARGIN = 0.03          # drafts are taken only if they promise this much more work per second (the
                           # step times and rates are estimates: at break-even, noise would decide)

    def __init__(self, config: SpeculativeConfig, cost: StepCostModel | None = None):
        self.config = config
        self.proposer = config.proposer()
        self.times = StepTimes(cost or StepCostModel())
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self.rate = 0.5            # the proposer's acceptance rate per draft token, over all requests (EWMA)
        # request id -> [accepted, proposed, steps since a draft, steps to wait before a probe]
        self._record: dict[str, list[float]] = {}

    @staticmethod
    def eligible(req: Request) -> bool:
        """Whether the request may speculate: it generates, and follows no grammar (the masks of the
        positions after a draft would need the grammar advanced through it)."""
        return req.params.pooling is None and req.grammar is None

    def acceptance(self, rid: str) -> float:
        acc, prop = self._record.get(rid, (0.0, 0.0))[:2]
        return (acc + self.PRIOR_WEIGHT * self.rate) / (prop + self.PRIOR_WEIGHT)

    def drafts(self, decodes: list[Request], other_tokens: int, budget: int) -> dict[str, list[int]]:
        """Drafts for this step's decodes (request id -> proposed tokens), at most `budget` draft
        tokens in all; `other_tokens`: the step's expected tokens besides the decodes."""
        cfg = self.config
        budget = min(budget, cfg.num_speculative_tokens * len(decodes))
        if budget <= 0:
            return {}
        proposals = {}
        for req in decodes:
            room = min(cfg.num_speculative_tokens, req.max_tokens - req.num_output_tokens - 1)
            if room > 0 and self.eligible(req):
                tokens = self.proposer.propose(req, room)
                if tokens:
                    proposals[req.request_id] = tokens
        if not proposals:
            return {}
        if not cfg.adaptive:
            return self._take_in_order(proposals, budget)
        # The step's work: its decodes' tokens and its other tokens (prefill chunks), per second.
        base = len(decodes) + other_tokens
        # (gain of the j-th draft, request id, j): a request's gains fall with j, so best first keeps prefixes
        candidates = []
        for rid, tokens in proposals.items():
            a = self.acceptance(rid)
            candidates += [(a ** j, rid, j) for j in range(1, len(tokens) + 1)]
        candidates.sort(key=lambda c: -c[0])
        candidates = candidates[:budget]
        # The best prefix of the candidates (the cost curve need not be convex: a longer prefix can
        # win after a shorter one lost).
        best, best_n, gain = base / self.times(base) * (1 + self.MARGIN), 0, 0.0
        for n, (g, _, _) in enumerate(candidates, 1):
            gain += g
            value = (base + gain) / self.times(base + n, against=base)
            if value > best:
                best, best_n = value, n
        take = {}
        for _, rid, j in candidates[:best_n]:
            take[rid] = max(j, take.get(rid, 0))
        extra = best_n
        for rid in proposals:   # the ones left out: a single draft now and then, so their rate can recover
            rec = self._record.setdefault(rid, [0.0, 0.0, 0, self.PROBE_EVERY])
            if rid in take:
                rec[2], rec[3] = 0, self.PROBE_EVERY
            else:
                rec[2] += 1
                if rec[2] >= rec[3] and extra < budget:
                    take[rid], rec[2], extra = 1, 0, extra + 1
                    rec[3] = min(2 * rec[3], self.PROBE_MAX)
        return {rid: proposals[rid][:j] for rid, j in take.items()}

    @staticmethod
    def _take_in_order(proposals: dict[str, list[int]], budget: int) -> dict[str, list[int]]:
        out = {}
        for rid, tokens in proposals.items():
            if budget <= 0:
                break
            out[rid] = tokens[:budget]
            budget -= len(out[rid])
        return out

    def observe(self, rid: str, proposed: int, accepted: int) -> None:
        """A verification's result: `accepted` of the request's `proposed` drafts were kept."""
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += proposed
        s.num_accepted_tokens += accepted
        for j in range(accepted):
            s.accepted_per_pos[j] += 1
        rec = self._record.setdefault(rid, [0.0, 0.0, 0, self.PROBE_EVERY])
        # Per draft token: accepted ones, plus the first refused one (the ones after it were never tested).
        tested = min(proposed, accepted + 1)
        rec[0] += accepted
        rec[1] += tested
        self.rate += 0.05 * (accepted / tested - self.rate) if tested else 0.0

    def observe_step(self, tokens: int, seconds: float) -> None:
        self.times.observe(tokens, seconds)

    def finished(self, req: Request) -> None:
        self._record.pop(req.request_id, None)
        self.proposer.finished(req)

    def snapshot(self) -> dict[str, Any]:
        s = self.stats
        return {"num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
                "num_accepted_tokens": s.num_accepted_tokens, "accepted_per_pos": list(s.accepted_per_pos),
                "acceptance_rate": s.num_accepted_tokens / s.num_draft_tokens if s.num_draft_tokens else math.nan}
