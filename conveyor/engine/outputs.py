"""What the engine hands back to callers (vLLM-shaped)."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.request import RequestMetrics


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float] | None] | None = None
    finish_reason: str | None = None      # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    delta_text: str = ""                  # new since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)

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
    num_cached_tokens: int = 0
    # params.prompt_logprobs: per prompt token {token id: logprob} (its own and the top-k); the first is None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    embedding: list[float] | None = None   # params.pooling: the prompt's normalised embedding
