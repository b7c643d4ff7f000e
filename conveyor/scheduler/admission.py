"""Admission control: how many tokens will a request occupy over its whole life?

Each policy predicts a request's final length (prompt + output). The scheduler admits a new
request only if its predicted blocks fit beside what the running requests are still
predicted to need, plus a reservation buffer of free blocks.

- optimistic:   the tokens known now (the prompt; vLLM's behaviour). Many admissions, may
                preempt later when outputs grow.
- conservative: prompt + max_tokens (TGI's behaviour). Never preempts; starves the queue
                when max_tokens is large and outputs are short.
- predictive:   prompt + the q-quantile of the output-length distribution profiled online
                from finished requests, conditioned on what a running request has already
                generated, plus a reservation buffer. q and the buffer are the knobs.
"""

from __future__ import annotations

import math
from typing import Protocol

from conveyor.request import Request


class OutputLengthProfile:
    """Online, exponentially decaying histogram of output lengths in log2-spaced buckets, with a prior.

    Buckets: [1], [2,3], [4,7], ... up to max_len. A quantile is answered with the largest
    length seen in its bucket (never more than the bucket's upper edge). Each observation
    weighs 1 when it arrives and half as much ``half_life`` observations later, so the
    estimate follows a workload whose lengths shift (0 = no decay: every observation
    counts forever). Before data exists, ``prior_weight`` pseudo-observations sit at
    ``prior_length`` and predict exactly that; they decay like real ones.
    """

    def __init__(self, max_len: int = 1 << 16, prior_length: int = 512, prior_weight: float = 4.0,
                 half_life: float = 256.0):
        self.num_buckets = max(1, math.ceil(math.log2(max_len + 1)))
        self.counts = [0.0] * self.num_buckets
        self.largest = [0] * self.num_buckets   # largest length seen in each bucket while it has weight
        self.decay = 0.5 ** (1.0 / half_life) if half_life > 0 else 1.0
        self.weight = 1.0   # what a new observation adds; grows by 1/decay per observation (renormalised)
        b = self._bucket(prior_length)
        self.counts[b] = prior_weight
        self.largest[b] = prior_length
        self.observed = 0
        self._cache: dict[tuple[float, int], int] = {}

    def _bucket(self, length: int) -> int:
        return min(self.num_buckets - 1, max(0, length).bit_length() - 1) if length > 0 else 0

    @staticmethod
    def _upper(bucket: int) -> int:
        return (2 << bucket) - 1

    @property
    def total(self) -> float:
        """The weight of everything observed (and of the prior), in units of a new observation."""
        return sum(self.counts) / self.weight

    def observe(self, length: int) -> None:
        # Decay without touching every bucket: later observations weigh more (1/decay each time);
        # renormalise before the weights overflow.
        self.weight /= self.decay
        if self.weight > 1e100:
            self.counts = [c / self.weight for c in self.counts]
            self.weight = 1.0
        b = self._bucket(length)
        if self.counts[b] < 1e-6 * sum(self.counts):   # the bucket had faded away: forget its old maximum
            self.largest[b] = 0
        self.counts[b] += self.weight
        self.largest[b] = max(self.largest[b], length)
        self.observed += 1
        self._cache.clear()

    def quantile(self, q: float, at_least: int = 0) -> int:
        """q-quantile of the length given length > at_least (cached until the next observation)."""
        start = self._bucket(at_least + 1)
        key = (q, start)
        if key not in self._cache:
            self._cache[key] = self._quantile(q, start)
        answer = self._cache[key]
        if answer is None:   # nothing this long seen yet: guess it doubles
            return max(at_least + 1, 2 * at_least)
        return max(at_least + 1, answer)

    def _quantile(self, q: float, start: int) -> int | None:
        mass = sum(self.counts[start:])
        if mass <= 0:
            return None
        acc = 0.0
        for b in range(start, self.num_buckets):
            acc += self.counts[b]
            if acc >= q * mass * (1 - 1e-12):
                return self.largest[b] or self._upper(b)
        return self._upper(self.num_buckets - 1)


class AdmissionPolicy(Protocol):
    name: str
    buffer_fraction: float

    def predicted_total(self, request: Request) -> int:
        """Predicted final number of tokens (prompt + output) of the request."""

    def observe(self, request: Request) -> None:
        """Learn from a finished request."""


class OptimisticAdmission:
    name = "optimistic"

    def __init__(self, buffer_fraction: float = 0.0):
        self.buffer_fraction = buffer_fraction

    def predicted_total(self, request: Request) -> int:
        return max(request.num_tokens, request.num_prompt_tokens)

    def observe(self, request: Request) -> None:
        pass


class ConservativeAdmission:
    name = "conservative"

    def __init__(self, buffer_fraction: float = 0.0):
        self.buffer_fraction = buffer_fraction

    def predicted_total(self, request: Request) -> int:
        return request.num_prompt_tokens + request.max_tokens

    def observe(self, request: Request) -> None:
        pass


class PredictiveAdmission:
    name = "predictive"

    def __init__(self, quantile: float = 0.9, buffer_fraction: float = 0.05,
                 profile: OutputLengthProfile | None = None, half_life: float = 256.0):
        self.quantile = quantile
        self.buffer_fraction = buffer_fraction
        self.profile = profile or OutputLengthProfile(half_life=half_life)

    def predicted_total(self, request: Request) -> int:
        generated = request.num_output_tokens
        predicted = self.profile.quantile(self.quantile, at_least=generated)
        return request.num_prompt_tokens + min(request.max_tokens, max(predicted, generated + 1))

    def observe(self, request: Request) -> None:
        self.profile.observe(request.num_output_tokens)


def make_admission_policy(name: str, quantile: float = 0.9, buffer_fraction: float = 0.05,
                          half_life: float = 256.0) -> AdmissionPolicy:
    if name == "optimistic":
        return OptimisticAdmission()
    if name == "conservative":
        return ConservativeAdmission()
    if name == "predictive":
        return PredictiveAdmission(quantile, buffer_fraction, half_life=half_life)
    raise ValueError(f"unknown admission policy {name!r}")
