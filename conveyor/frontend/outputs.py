"""What the engine hands back to callers (vLLM-shaped)."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.request import RequestMetrics


class Logprob(float):
    """A token's logprob: a float (so {token: logprob} dicts keep working) that also has vLLM's
    Logprob fields. `rank` is the position under the model's raw logits (1 = most likely): exact
    for the sampled (or prompt) token, even outside the requested top-k."""

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None):
        obj = super().__new__(cls, logprob)
        obj.rank, obj.decoded_token = rank, decoded_token
        return obj

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self):
        return Logprob, (float(self), self.rank, self.decoded_token)


@dataclass(slots=True)
class CompletionOutput:
    """One sequence's output, owned by whoever receives it: nothing in it is changed by the engine
    afterwards, so a stream may read it on another thread while the next step runs.

    ``delta_text``, ``delta_token_ids`` and ``delta_logprobs`` are what this output adds to the previous
    output of its request (streams read these; ``delta_logprobs[i]`` is ``delta_token_ids[i]``'s entry).
    ``text`` is the text so far. ``token_ids`` and ``logprobs`` are the whole sequence's: on the finished
    output (its own lists); a running output has ``token_ids`` None (copying them every step would cost
    O(length) per step): accumulate the deltas to follow them."""

    index: int
    text: str
    token_ids: list[int] | None
    logprobs: list[dict[int, float] | None] | None = None
    finish_reason: str | None = None      # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    delta_text: str = ""                  # new since the previous output of this request
    delta_token_ids: tuple[int, ...] = ()
    cumulative_logprob: float | None = None   # with logprobs: the sum of the sampled tokens' logprobs
    delta_logprobs: tuple[dict[int, float] | None, ...] | None = None   # with logprobs: the new tokens' entries

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: list[RequestMetrics] = field(default_factory=list)
    error: str | None = None
    error_code: str | None = None   # with error: its kind ("queue_timeout"; None: an engine failure)
    num_cached_tokens: int = 0
    # params.prompt_logprobs: per prompt token {token id: Logprob} (its own and the top-k); the first is None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    embedding: list[float] | None = None   # params.pooling: the prompt's normalised embedding
