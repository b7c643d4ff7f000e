"""Cost models: how long a step's plan takes. No torch here.

Below both of their users: the engine fills the scheduler's preemption costs from a profiled
``StepCostModel`` (``preemption_costs``), and the simulator's executor advances its clock by one
(sim/simulator.py). ``conveyor.sim.cost`` re-exports these names.

A cost model has ``step_time(plan)`` (seconds for the forward pass, sampling and the engine's
own work of one step) and ``swap_time(num_blocks)`` (one direction). Two kinds:

- ``StepCostModel``: the step's token count through a measured piecewise-linear curve, plus
  fitted costs per KV token the decodes read, per query-key pair of prefill chunks, per sampled
  sequence and per sequence. ``conveyor profile`` fits it to the real engine on this machine
  (conveyor/profile.py).
- ``RooflineCostModel`` (sim/roofline.py): a named GPU's published peak FLOP/s and bandwidth
  applied to the model's shapes — a model, not a measurement.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Protocol

from conveyor.scheduler.config import SchedulerConfig
from conveyor.scheduler.output import SchedulerOutput
from conveyor.scheduler.preemption import PreemptionCosts


class CostModel(Protocol):
    def step_time(self, plan: SchedulerOutput) -> float: ...

    def swap_time(self, num_blocks: int) -> float: ...

    def recompute_time_per_token(self, context: int = 256) -> float: ...


def with_preemption_costs(config: SchedulerConfig, cost: CostModel | None) -> SchedulerConfig:
    """The scheduler's knobs with the auto preemption mode's costs that the user left unset
    (None) taken from a cost model; a cost the user set wins over the model."""
    if cost is None:
        return config
    return replace(config, swap_cost_per_block=_first(config.swap_cost_per_block, lambda: cost.swap_time(1)),
                   recompute_cost_per_token=_first(config.recompute_cost_per_token,
                                                   cost.recompute_time_per_token))


def preemption_costs(config: SchedulerConfig, cost: CostModel | None) -> PreemptionCosts:
    """What the scheduler's per-victim choice uses: the user's constants, else the cost model's
    swap time per block and its step-cost curve for recomputing n tokens (attention included,
    so a long recomputation costs more per token than a short one)."""
    filled = with_preemption_costs(config, cost)
    costs = PreemptionCosts.of(filled)
    if cost is not None and config.recompute_cost_per_token is None:
        costs.recompute_time = lambda n: n * cost.recompute_time_per_token(n)
    return costs


def _first(value: float | None, fallback) -> float:
    return value if value is not None else fallback()


@dataclass(slots=True)
class StepShape:
    """The features of a plan that its cost depends on."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    decode_context: int = 0        # tokens of KV the decodes attend to (their contexts, the new token included)
    prefill_attention: float = 0   # query-key pairs of the prefill chunks: sum of n * (cached + (n + 1) / 2)
    num_seqs: int = 0
    num_sampled: int = 0           # sequences whose logits are computed and sampled
    prefill_context: int = 0       # cached tokens the prefill chunks attend to (not a linear feature)

    @classmethod
    def of(cls, plan: SchedulerOutput) -> StepShape:
        s = cls(num_seqs=len(plan.scheduled))
        for seq in plan.scheduled:
            n, c = seq.num_tokens, seq.num_computed_tokens
            if n == 1 and c > 0:     # the runner's own test for a decode
                s.decode_tokens += 1
                s.decode_context += c + 1
            elif seq.num_drafts and seq.sample and c > 0:
                # a speculative verification runs as n single-token decodes at consecutive positions,
                # each sampled (runner/inputs.py), not as a prefill chunk
                s.decode_tokens += n
                s.decode_context += n * c + n * (n + 1) // 2
                s.num_seqs += n - 1
                s.num_sampled += n - 1
            else:
                s.prefill_tokens += n
                s.prefill_context += c
                s.prefill_attention += n * (c + (n + 1) / 2)
            s.num_sampled += seq.sample
        return s

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


@dataclass(slots=True)
class StepCostModel:
    """Seconds per step = M(tokens) + c(sequences decoding) * (KV tokens the decodes read)
    + prefill_attention * (query-key pairs of the prefill chunks) + sampled * (sampled sequences)
    + seq * (sequences); c is ``decode_context``, or per number of sequences decoding where the
    profile fitted one (``context_slopes``).

    M, the cost of a step's matmuls (and everything else fixed or per token), is piecewise
    linear through measured token counts (``knots``, ``knot_costs``): on a CPU the cost per token
    is far from constant (matrix-vector products at 1-2 tokens, small-M GEMMs after), and a
    straight line misses by 30%. Beyond the last knot it extends the last segment. The defaults
    roughly fit SmolLM2-135M fp32 on 2 CPU cores; `conveyor profile` measures this machine's.
    """

    knots: list[int] = field(default_factory=lambda: [1, 2, 4, 16, 64, 256, 1024])
    knot_costs: list[float] = field(default_factory=lambda: [0.023, 0.024, 0.040, 0.045, 0.090, 0.20, 0.80])
    decode_context: float = 3.5e-6
    prefill_attention: float = 3.0e-7
    sampled: float = 5.0e-4
    seq: float = 2.0e-5
    swap_block: float = 2.0e-4       # seconds to copy one KV block one way
    kv_bytes_per_token: int = 0      # of the profiled model and dtype (0: unknown); sizes a KV cache in GiB
    meta: dict = field(default_factory=dict)   # where the numbers come from: machine, model, fit quality
    # A correction fitted from a real run's step trace (``conveyor simulate --validate TRACE
    # --calibrate OUT``, ``conveyor profile --sustained``; sim/validate.py): the step's time above is
    # multiplied by a factor piecewise linear in its token count (one curve for decode-only steps,
    # one for steps with a prefill chunk; empty: 1), and every step is followed by `between_steps`
    # more seconds before the next one starts (work outside the step the profile did not see: the
    # front end's, the loop's). The simulator waits that long after each step, its tokens stamped
    # before (sim/harness.py).
    decode_scales: list[float] = field(default_factory=list)    # per knot
    prefill_scales: list[float] = field(default_factory=list)   # per knot
    between_steps: float = 0.0
    # A step's cost also depends on the step before it: a prefill chunk's activations evict the weights
    # the decode steps keep warm in the CPU's caches, and the decode steps after it read them from
    # memory again, recovering over several steps (measured on an AMX Xeon with a ~64-100 MB
    # effective L3: +3 ms on a 3.1 ms batch-1 step right after a 256-token chunk, +2.6, +2.1, +1.6,
    # ... ~13 ms in all; +0.8 ms after an 8-token one). ``after_prefill[i][k]``: the extra seconds of
    # the k-th decode-only step after a step carrying ``after_prefill_tokens[i]`` prefill tokens
    # (interpolated between, flat past the ends; `conveyor profile` measures it; empty: none).
    after_prefill_tokens: list[int] = field(default_factory=list)
    after_prefill: list[list[float]] = field(default_factory=list)
    # The cost per KV token the decodes read falls with the number of sequences decoding together
    # (measured on a Zen4 VM, bf16, one and two threads: one sequence 1.45-1.5x the slope fitted for
    # all, 32 sequences 0.9x; one shared slope priced batch-1 decode steps up to 6% high at short
    # contexts and 9% low at 1024). ``context_slopes[i]``: the slope with ``context_batches[i]``
    # sequences decoding (interpolated between, flat past the ends; `conveyor profile` fits them);
    # empty: ``decode_context`` whatever the batch.
    context_batches: list[int] = field(default_factory=list)
    context_slopes: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.knots) != len(self.knot_costs) or not self.knots or sorted(set(self.knots)) != list(self.knots):
            raise ValueError("knots must be increasing token counts, one cost each")
        if any(len(c) not in (0, len(self.knots)) for c in (self.decode_scales, self.prefill_scales)):
            raise ValueError("a correction curve has one factor per knot (or none)")
        if len(self.after_prefill) != len(self.after_prefill_tokens) or \
                sorted(set(self.after_prefill_tokens)) != list(self.after_prefill_tokens):
            raise ValueError("after_prefill: one curve per prefill size, sizes increasing")
        if len(self.context_slopes) != len(self.context_batches) or \
                sorted(set(self.context_batches)) != list(self.context_batches):
            raise ValueError("context_slopes: one slope per batch size, sizes increasing")

    def after_prefill_time(self, prefill_tokens: int, k: int) -> float:
        """Extra seconds of the k-th (from 0) decode-only step after a step that carried
        `prefill_tokens` prefill tokens (0 without a measured transition, and for k < 0: a step
        that is not such a decode step, as ``AfterPrefill.advance`` reports it)."""
        if not self.after_prefill or k < 0:
            return 0.0
        weights = flat_hat_weights(self.after_prefill_tokens, prefill_tokens)
        return sum(w * (curve[k] if k < len(curve) else 0.0) for w, curve in zip(weights, self.after_prefill))

    def context_slope(self, decoding: int) -> float:
        """Seconds per KV token read with `decoding` sequences decoding in the step."""
        if not self.context_batches:
            return self.decode_context
        return interpolate_flat(self.context_batches, self.context_slopes, decoding)

    def token_cost(self, tokens: int) -> float:
        return sum(w * c for w, c in zip(hat_weights(self.knots, tokens), self.knot_costs))

    def step_time(self, plan: SchedulerOutput) -> float:
        return self.shape_time(StepShape.of(plan))

    def shape_time(self, s: StepShape) -> float:
        """A step of this shape (without `between_steps`, which follows it)."""
        t = (self.token_cost(s.tokens) + self.context_slope(s.decode_tokens) * s.decode_context
             + self.prefill_attention * s.prefill_attention + self.sampled * s.num_sampled + self.seq * s.num_seqs)
        return t * self.scale(s)

    def scale(self, s: StepShape) -> float:
        """The trace-fitted correction factor for a step of this shape (1 without one)."""
        curve = self.prefill_scales if s.prefill_tokens else self.decode_scales
        if not curve:
            return 1.0
        return max(0.0, interpolate_flat(self.knots, curve, s.tokens))

    def swap_time(self, num_blocks: int) -> float:
        return num_blocks * self.swap_block

    def scaled(self, factor: float, by_tokens: dict[int, float] | None = None) -> StepCostModel:
        """This model on a machine `factor` times slower (every time it prices multiplied by it):
        what a speed check (``conveyor profile --recheck``) applies when the machine runs at another
        speed than when it was profiled. With `by_tokens` (a step's token count -> its factor, as the
        check measures them per probe step) the step-cost curve takes the factor interpolated at each
        knot's token count instead (flat past the ends): on a shared machine the small,
        memory-bound steps and the large, compute-bound ones drift apart (on a Zen4 VM a batch-1
        decode step ran 1.3-1.75x its profiled time while 32-sequence steps ran 0.85x), and so does
        the KV-read cost of B sequences decoding (``context_slopes``, at B tokens); every other term
        takes `factor`."""
        sizes, factors = map(list, zip(*sorted(by_tokens.items()))) if by_tokens else ([], [])

        def at(tokens: int) -> float:
            return interpolate_flat(sizes, factors, tokens) if sizes else factor

        return replace(self, knot_costs=[c * at(k) for c, k in zip(self.knot_costs, self.knots)],
                       decode_context=self.decode_context * factor, prefill_attention=self.prefill_attention * factor,
                       context_slopes=[c * at(b) for c, b in zip(self.context_slopes, self.context_batches)],
                       sampled=self.sampled * factor, seq=self.seq * factor, swap_block=self.swap_block * factor,
                       between_steps=self.between_steps * factor,
                       after_prefill=[[t * factor for t in curve] for curve in self.after_prefill], meta=dict(self.meta))

    def recompute_time_per_token(self, context: int = 256) -> float:
        """A preempted request's tokens computed again as one prefill chunk (about `context` long)."""
        s = StepShape(prefill_tokens=context, prefill_attention=context * (context + 1) / 2, num_seqs=1)
        return (self.shape_time(s) - self.token_cost(1) * self.scale(s)) / context

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"kind": "step", **asdict(self)}, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> StepCostModel:
        d = json.loads(Path(path).read_text())
        if d.pop("kind", None) != "step":
            raise ValueError(f"{path} is not a step cost model (the output of `conveyor profile`)")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class AfterPrefill:
    """What a step's cost depends on besides its own shape: how many decode-only steps ran since the
    last step that carried prefill tokens, and how many it carried. One per engine (replica), fed
    every executed step in order: the simulator's executor and `conveyor simulate --validate`."""

    __slots__ = ("last", "since")

    def __init__(self) -> None:
        self.last = 0      # prefill tokens of the last step that had some
        self.since = -1    # decode-only steps since (-1: no prefill yet)

    def advance(self, prefill_tokens: int, tokens: int) -> tuple[int, int]:
        """Take a step of `tokens` tokens, `prefill_tokens` of them prefill: its position, (prefill
        tokens of the last step before it that had some, decode-only steps between; -1 where it
        carries prefill itself, has no tokens, or no prefill came before)."""
        if prefill_tokens:
            self.last, self.since = prefill_tokens, 0
            return self.last, -1
        if self.since < 0 or not tokens:
            return self.last, -1
        self.since += 1
        return self.last, self.since - 1

    def extra(self, cost: object, prefill_tokens: int, tokens: int) -> float:
        """The extra seconds of that step under `cost` (none for a model without
        ``after_prefill_time``), the state advanced."""
        last, since = self.advance(prefill_tokens, tokens)
        after = getattr(cost, "after_prefill_time", None)
        return after(last, since) if after is not None else 0.0


def hat_weights(knots: list[int], x: float) -> list[float]:
    """Weights of each knot's value in the piecewise-linear interpolation at x (extrapolating
    past the ends along the first / last segment)."""
    w = [0.0] * len(knots)
    if len(knots) == 1:
        w[0] = 1.0
        return w
    i = max(0, min(bisect.bisect_right(knots, x) - 1, len(knots) - 2))
    lo, hi = knots[i], knots[i + 1]
    f = (x - lo) / (hi - lo)
    w[i], w[i + 1] = 1.0 - f, f
    return w


def flat_hat_weights(knots: list[int], x: float) -> list[float]:
    """``hat_weights`` flat past the ends: x clamped to the first and last knot."""
    return hat_weights(knots, min(max(x, knots[0]), knots[-1]))


def interpolate_flat(knots: list[int], values: list[float], x: float) -> float:
    """The piecewise-linear function through (knots, values) at x, flat past the ends."""
    return sum(w * v for w, v in zip(flat_hat_weights(knots, x), values))
