"""Speculative decoding's side of the scheduler: which requests propose tokens this step, and how many.

Each step the scheduler asks the speculator for the drafts of its running decodes before it
schedules them. A draft is up to ``num_speculative_tokens`` tokens from the proposer (proposers.py);
the scheduler schedules it as extra query tokens of its request (they count against the step's
token budget and take KV slots), the runner verifies them in the same forward pass as everyone
else's work, and ``observe`` learns how many were accepted.

How many, by cost: a step of T tokens (its decodes and prefill chunks) costs C(T) and does T tokens
of work. The j-th draft of a request is worth the probability that its first j drafts are all
accepted: the request's own rate for a first draft (shrunk toward the overall one), times the overall
rates of each later draft given the ones before it were accepted (acceptances come in runs: a copied
passage goes on, so these run well above the first draft's). Candidates sorted best first,
the step takes the prefix of them with the most expected work per second, (T + gain) / C(T + drafts)
(the best prefix, not the first that stops improving: C need not be convex), if it beats none by
3% (the costs and rates are estimates). At batch 1 on a CPU,
where the step reads every weight once whatever its rows, several drafts cost little; with a large
batch the step is compute-bound, an extra row costs about as much as a whole decode, and speculation
turns itself off. C comes from the decode-step times this engine measured: a line through the
median (size, time) of each token-count bucket measured lately, extended past the ends along the
profile's (or the default) step-cost curve. A request
that stopped speculating tries a single draft now and then (after 16 steps, the wait doubling after
each probe that did not lead to more, up to 512), so a rate can recover.

No torch here: the simulator drives the same class (its executor draws acceptances).
"""

from __future__ import annotations

import bisect
import json
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
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

    Each token-count bucket keeps the median size and time of its latest steps (robust to the odd slow
    step: a first use of a shape, another process on the cores): a point. A size
    is priced on the line through the points (never falling), past the ends along the cost model's
    curve: the cost of an extra row is what this engine measured it to be, at this batch.
    Points measured long ago (more than ``stale`` steps back) describe other contexts and batches:
    pricing a step against the planned one (`against`) leaves them out. With one point, the cost
    model's curve through it; with none, the curve times 1."""

    KEEP = 9   # steps per bucket whose median is its point

    def __init__(self, model: StepCostModel, stale: int = 64):
        self.model = model
        self.stale = stale
        self.points: dict[int, list[float]] = {}   # bucket -> [median tokens, median seconds, last step]
        self._recent: dict[int, deque] = {}
        self._steps = 0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not seconds > 0:
            return
        self._steps += 1
        b = _bucket(tokens)
        recent = self._recent.get(b)
        if recent is None or self._steps - self.points[b][2] > self.stale:   # (stale ones are forgotten)
            recent = self._recent[b] = deque(maxlen=self.KEEP)
        recent.append((tokens, seconds))
        self.points[b] = [statistics.median(t for t, _ in recent), statistics.median(sec for _, sec in recent),
                          self._steps]

    def __call__(self, tokens: int, against: int | None = None) -> float:
        """A step of `tokens`; `against`: the size it is compared with (the step as planned)."""
        return self.pricer(against)(tokens)

    def pricer(self, against: int | None = None) -> Callable[[int], float]:
        """Step sizes -> seconds, as of now (one step's many prices share the work)."""
        pts = sorted((t, sec) for t, sec, when in self.points.values()
                     if against is None or self._steps - when <= self.stale)
        model = self.model
        if not pts:
            return model.token_cost
        if len(pts) == 1:
            (t0, s0), = pts
            scale = s0 / model.token_cost(max(1, round(t0)))
            return lambda tokens: scale * model.token_cost(tokens)
        sizes = [t for t, _ in pts]

        def price(tokens: int) -> float:
            i = bisect.bisect_left(sizes, tokens)
            if 0 < i < len(pts):   # between two points
                (t1, s1), (t2, s2) = pts[i - 1], pts[i]
                return s1 + max(0.0, s2 - s1) * (tokens - t1) / (t2 - t1)
            # past an end: from it along the cost model's curve (a step's cost on a CPU is far from
            # linear in its rows; a line through two close, noisy points would be worse)
            t0, s0 = pts[-1] if i else pts[0]
            return s0 * model.token_cost(tokens) / model.token_cost(max(1, round(t0)))

        return price


class Speculator:
    """Drafts per step for the scheduler (see the module docstring)."""

    PRIOR_WEIGHT = 8.0     # the overall first-draft rate counts as this many verifications of a request's own
    PROBE_EVERY = 16       # a request not speculating tries one draft after this many steps ...
    PROBE_MAX = 512        # ... the wait doubling after each probe that is not taken up, to at most this
    MARGIN = 0.03          # drafts are taken only if they promise this much more work per second (the
                           # step times and rates are estimates: at break-even, noise would decide)
    EXPLORE_EVERY = 20     # the guard: after this many steps the arm that looks worse runs EXPLORE_STEPS
    EXPLORE_STEPS = 5      # steps in a row, the wait doubling while it stays worse,
    EXPLORE_MAX = 640      # to at most this ...
    ARM_KEEP = 9           # ... each arm judged by the median of its latest this many steps

    def __init__(self, config: SpeculativeConfig, cost: StepCostModel | None = None):
        self.config = config
        self.proposer = config.proposer()
        self.times = StepTimes(cost or StepCostModel())
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        # Acceptance, over all requests (EWMAs): of a verification's first draft, and of its j-th draft
        # given the ones before it were accepted (cond[j], j >= 1; index 0 unused). Acceptances come in
        # runs (a copied passage goes on), so cond runs well above rate, and a**j would undervalue
        # long drafts.
        self.rate = 0.5
        self.cond = [0.8] * config.num_speculative_tokens   # (a run's next draft: a likelier guess)
        # ... of a first draft by the length of the n-gram match that proposed it (where the proposer
        # tells: a 1-token match guesses far worse than a 4-token one); unseen lengths take `rate`
        self.rate_by_match: dict[int, float] = {}
        # request id -> [first drafts accepted, verifications, steps since a draft, steps to wait before a
        # probe, match length of its latest proposal]
        self._record: dict[str, list[float]] = {}
        # The guard (``_arm``): per batch-size bucket, seconds per generated token of the latest decode
        # steps that could speculate (on) and that could not (off), and the steps decided there.
        self.arms: dict[tuple[int, bool], deque] = {}
        # bucket -> [steps decided, next exploring step, wait, last best arm, exploring steps left]
        self._decided: dict[int, list] = {}
        self._step_arm: tuple[int, bool] | None = None

    @staticmethod
    def eligible(req: Request) -> bool:
        """Whether the request may speculate: it generates (embeddings do not)."""
        return req.params.pooling is None

    def acceptance(self, rid: str, match: int = 0) -> float:
        """P(the request's next first draft is accepted): its record shrunk toward the overall rate
        for proposals from a match of this length."""
        acc, tried = self._record.get(rid, (0.0, 0.0))[:2]
        prior = self.rate_by_match.get(match, self.rate)
        return (acc + self.PRIOR_WEIGHT * prior) / (tried + self.PRIOR_WEIGHT)

    def drafts(self, decodes: list[Request], other_tokens: int, budget: int) -> dict[str, list[int]]:
        """Drafts for this step's decodes (request id -> proposed tokens), at most `budget` draft
        tokens in all; `other_tokens`: the step's expected tokens besides the decodes."""
        cfg = self.config
        self._step_arm = None
        budget = min(budget, cfg.num_speculative_tokens * len(decodes))
        if budget <= 0:
            return {}
        if cfg.adaptive and not self._arm(len(decodes), other_tokens):
            return {}
        proposals, matches = {}, {}
        match_length = getattr(self.proposer, "match_length", None)
        for req in decodes:
            room = min(cfg.num_speculative_tokens, req.max_tokens - req.num_output_tokens - 1)
            if room > 0 and self.eligible(req):
                tokens = self.proposer.propose(req, room)
                if tokens and req.grammar is not None:   # structured outputs: what its grammar can take
                    tokens = tokens[:req.grammar.validate_tokens(tokens)]
                if tokens:
                    proposals[req.request_id] = tokens
                    matches[req.request_id] = match_length(req) if match_length is not None else 0
        if not proposals:
            return {}
        if not cfg.adaptive:
            return self._take_in_order(proposals, budget)
        # The step's work: its decodes' tokens and its other tokens (prefill chunks), per second.
        base = len(decodes) + other_tokens
        # (gain of the j-th draft, request id, j): a request's gains fall with j, so best first keeps prefixes
        candidates = []
        for rid, tokens in proposals.items():
            g = self.acceptance(rid, matches[rid])
            for j in range(1, len(tokens) + 1):   # P(the first j drafts are all accepted)
                candidates.append((g, rid, j))
                g *= self.cond[j] if j < len(self.cond) else 0.0
        candidates.sort(key=lambda c: -c[0])
        candidates = candidates[:budget]
        # The best prefix of the candidates (the cost curve need not be convex: a longer prefix can
        # win after a shorter one lost).
        price = self.times.pricer(against=base)
        best, best_n, gain = base / price(base) * (1 + self.MARGIN), 0, 0.0
        for n, (g, _, _) in enumerate(candidates, 1):
            gain += g
            value = (base + gain) / price(base + n)
            if value > best:
                best, best_n = value, n
        take = {}
        for _, rid, j in candidates[:best_n]:
            take[rid] = max(j, take.get(rid, 0))
        extra = best_n
        for rid in proposals:   # the ones left out: a single draft now and then, so their rate can recover
            rec = self._record.setdefault(rid, [0.0, 0.0, 0, self.PROBE_EVERY, 0])
            rec[4] = matches[rid]
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
        if proposed <= 0:
            return
        rec = self._record.setdefault(rid, [0.0, 0.0, 0, self.PROBE_EVERY, 0])
        rec[0] += accepted > 0
        rec[1] += 1
        self.rate += 0.05 * ((accepted > 0) - self.rate)
        by_match = self.rate_by_match.get(rec[4], self.rate)
        self.rate_by_match[rec[4]] = by_match + 0.05 * ((accepted > 0) - by_match)
        # drafts 2.. that were tested: those up to the first refused one
        for j in range(1, min(proposed, accepted + 1)):
            self.cond[j] += 0.05 * ((j < accepted) - self.cond[j])

    def _arm(self, batch: int, other_tokens: int) -> bool:
        """The guard on the cost model: whether this step may speculate. For a decode-only step, the
        arm (speculating or not) with fewer seconds per generated token (the median of its latest
        steps) at this batch size (bucket), and each until it has 5 steps. The other arm runs
        EXPLORE_STEPS steps in a row (enough to move its median) after EXPLORE_EVERY steps there, the
        wait doubling while it stays worse (up to EXPLORE_MAX):
        whatever the estimates say, speculation that measures slower than none is soon left off, and
        checking that it still is costs ever less."""
        if other_tokens:   # (steps with prefill chunks are not measured: the cost model decides)
            return True
        b = _bucket(batch)
        on = self.arms.setdefault((b, True), deque(maxlen=self.ARM_KEEP))
        off = self.arms.setdefault((b, False), deque(maxlen=self.ARM_KEEP))
        d = self._decided.setdefault(b, [0, self.EXPLORE_EVERY, self.EXPLORE_EVERY, None, 0])
        d[0] += 1
        if len(on) < 5 or len(off) < 5:
            arm = len(on) <= len(off)
        else:
            better = statistics.median(on) <= statistics.median(off)
            if better != d[3]:   # the other arm became the better one: explore often again
                d[1], d[2], d[3], d[4] = d[0] + self.EXPLORE_EVERY, self.EXPLORE_EVERY, better, 0
            arm = better
            if d[0] >= d[1] and not d[4]:   # time to explore the worse arm: a few steps in a row
                d[4] = self.EXPLORE_STEPS
                d[2] = min(2 * d[2], self.EXPLORE_MAX)
                d[1] = d[0] + self.EXPLORE_STEPS + d[2]
            if d[4]:
                arm, d[4] = not better, d[4] - 1
        self._step_arm = (b, arm)
        return arm

    def observe_step(self, tokens: int, seconds: float, generated: int = 0) -> None:
        """A decode-only step of `tokens` tokens took `seconds` (the whole step: planning, the forward
        pass, the update) and generated `generated` tokens."""
        self.times.observe(tokens, seconds)
        arm, self._step_arm = self._step_arm, None
        if arm is not None and generated > 0 and seconds > 0:
            self.arms[arm].append(seconds / generated)

    def finished(self, req: Request) -> None:
        self._record.pop(req.request_id, None)
        self.proposer.finished(req)

    def snapshot(self) -> dict[str, Any]:
        s = self.stats
        return {"num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
                "num_accepted_tokens": s.num_accepted_tokens, "accepted_per_pos": list(s.accepted_per_pos),
                "acceptance_rate": s.num_accepted_tokens / s.num_draft_tokens if s.num_draft_tokens else math.nan}
