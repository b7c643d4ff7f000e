"""Speculative decoding in the simulator: how often a request has a guess, and how much of it the model keeps.

Simulated requests have no real text, so a proposer cannot look anything up in it. Instead a workload
says two things (``SimSpeculation``):

- its **match rate**: the chance that the proposer has a guess at a given decode step (prompt lookup
  finds the last tokens earlier in the sequence: high when code is edited or a document quoted, low in
  open chat). ``SimProposer`` then proposes k placeholder tokens;
- its **acceptance**: the chance that each draft token is the one the model would have produced,
  independently, so a draft of k tokens keeps its first j with probability a**j (1 - a) (all k with
  a**k): a geometric number truncated at k. A mixture ("0.9:0.3,0.2:0.7") gives each request one of
  several rates (by weight), e.g. code-edit requests among chats.

Every draw is a hash of (seed, request id, output position): the same run gives the same draws, and
two runs that differ in their knobs see the same text (whether the token at position n of request r
is guessable does not depend on when it is guessed). The real ``Speculator`` picks the drafts per
step with the real cost model: only its proposer is replaced. The executor (simulator.py) draws the
accepted count and the oracle (harness.py) caps it at the request's remaining output. No torch here.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

from conveyor.request import Request
from conveyor.scheduler.costs import StepCostModel, StepShape
from conveyor.sim.harness import EOS
from conveyor.spec.speculator import SpeculativeConfig, Speculator

DEFAULT_ACCEPTANCE = 0.5   # each draft token right half the time
DEFAULT_MATCH_RATE = 1.0   # a guess at every step
DRAFT_TOKEN = EOS + 1      # the placeholder drafts: never EOS (the oracle alone ends a request)


def uniform(seed: int, tag: str, rid: str, position: int) -> float:
    """A deterministic draw in [0, 1) for this request and output position."""
    digest = hashlib.blake2b(f"{seed}/{tag}/{rid}/{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0 ** 64


def parse_acceptance(text: str | float) -> tuple[tuple[float, float], ...]:
    """'0.7' -> ((0.7, 1.0),); '0.9:0.3,0.2:0.7' -> rates with their weights (normalised)."""
    if isinstance(text, (int, float)):
        text = str(text)
    classes = []
    try:
        for item in filter(None, (t.strip() for t in text.split(","))):
            rate, _, weight = item.partition(":")
            classes.append((float(rate), float(weight) if weight else 1.0))
    except ValueError:
        classes = []
    if not classes or any(not 0 <= r <= 1 or not w > 0 or not math.isfinite(w) for r, w in classes):
        raise ValueError(f"bad acceptance {text!r}: a probability P, or P1:WEIGHT1,P2:WEIGHT2,... "
                         "(each P in 0..1, weights positive)")
    total = sum(w for _, w in classes)
    return tuple((r, w / total) for r, w in classes)


@dataclass(frozen=True, slots=True)
class SimSpeculation:
    """A workload's speculation: the acceptance distribution and the match rate (module docstring)."""

    acceptance: tuple[tuple[float, float], ...] = ((DEFAULT_ACCEPTANCE, 1.0),)   # (rate, weight) per class
    match_rate: float = DEFAULT_MATCH_RATE
    seed: int = 0
    _cumulative: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.acceptance, (str, int, float)):
            object.__setattr__(self, "acceptance", parse_acceptance(self.acceptance))
        if not 0 <= self.match_rate <= 1:
            raise ValueError(f"match rate {self.match_rate}: a probability in 0..1")
        acc, cum = 0.0, []
        for _, w in self.acceptance:
            acc += w
            cum.append(acc)
        object.__setattr__(self, "_cumulative", tuple(cum))

    @property
    def mean_acceptance(self) -> float:
        return sum(r * w for r, w in self.acceptance)

    def rate_of(self, rid: str) -> float:
        """The request's acceptance rate (its class, drawn once per request)."""
        if len(self.acceptance) == 1:
            return self.acceptance[0][0]
        u = uniform(self.seed, "class", rid, 0) * self._cumulative[-1]
        return next(r for (r, _), c in zip(self.acceptance, self._cumulative) if u < c)

    def has_guess(self, rid: str, position: int) -> bool:
        """Whether the proposer has a guess for the request's output token at this position."""
        return self.match_rate >= 1 or uniform(self.seed, "match", rid, position) < self.match_rate

    def accepted(self, rid: str, position: int, k: int) -> int:
        """How many of k drafts for output positions position.. the model keeps: each independently
        with the request's rate, up to the first refused one."""
        rate, j = self.rate_of(rid), 0
        while j < k and uniform(self.seed, "accept", rid, position + j) < rate:
            j += 1
        return j


class SimProposer:
    """A ``Proposer`` (conveyor/spec/proposers.py) for requests without real text: k placeholder
    tokens when the workload's match rate says it has a guess at this step, else none."""

    name = "simulated"

    def __init__(self, spec: SimSpeculation):
        self.spec = spec

    def propose(self, req: Request, k: int) -> list[int]:
        if k <= 0 or not self.spec.has_guess(req.request_id, req.num_output_tokens):
            return []
        return [DRAFT_TOKEN] * k

    def finished(self, req: Request) -> None:
        pass


class TokenCurve:
    """The Speculator's prior of a step's cost by its token count (``token_cost``) for a cost model
    that has none (the roofline): n decodes at no context. Its measured step times take over."""

    def __init__(self, cost: object):
        self.cost = cost

    def token_cost(self, tokens: float) -> float:
        n = max(1, int(round(tokens)))
        return self.cost.shape_time(StepShape(decode_tokens=n, decode_context=n, num_seqs=n, num_sampled=n))


def make_speculator(config: SpeculativeConfig, spec: SimSpeculation, cost: object) -> Speculator:
    """The engine's Speculator with the cost model's curve, its proposer replaced by ``SimProposer``."""
    if isinstance(cost, StepCostModel):
        curve = cost
    elif hasattr(cost, "shape_time"):
        curve = TokenCurve(cost)
    else:
        curve = None   # (a cost model without shapes: the default curve, scaled to the measured steps)
    speculator = Speculator(config, curve)
    speculator.proposer = SimProposer(spec)
    return speculator


def spec_summary(speculators: list[Speculator], output_tokens: int) -> dict[str, float]:
    """The replicas' spec-decode counters together: verifications with drafts, draft tokens, accepted
    ones, acceptance rate (accepted / draft tokens), first-position rate (an estimate of the per-token
    acceptance), tokens per verification (1 + accepted per draft) and per request step (output tokens
    / steps that sampled one of them)."""
    drafts = sum(s.stats.num_drafts for s in speculators)
    draft_tokens = sum(s.stats.num_draft_tokens for s in speculators)
    accepted = sum(s.stats.num_accepted_tokens for s in speculators)
    first = sum(s.stats.accepted_per_pos[0] for s in speculators if s.stats.accepted_per_pos)
    sampling_steps = output_tokens - accepted
    return {"spec_drafts": drafts, "spec_draft_tokens": draft_tokens, "spec_accepted_tokens": accepted,
            "spec_acceptance_rate": accepted / draft_tokens if draft_tokens else math.nan,
            "spec_first_position_rate": first / drafts if drafts else math.nan,
            "spec_tokens_per_draft": 1 + accepted / drafts if drafts else math.nan,
            "spec_tokens_per_step": output_tokens / sampling_steps if sampling_steps > 0 else math.nan}
