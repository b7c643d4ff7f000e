"""The contract between the scheduler and an executor: what to run, and what came out.

Plain data only (ids, token ids, positions, block tables, sampling parameters): an executor
never sees a live ``Request``, so it can live in another process. The scheduler does not
touch a plan's lists after handing it over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conveyor.sampling.params import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs of one sequence that samples a token this step."""

    params: SamplingParams
    seed: int                                  # effective seed: params.seed, or one the engine drew
    num_output_tokens: int                     # generated so far, before this step
    # Token history, present only when a penalty needs it (prompt: repetition penalty only).
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None


@dataclass(slots=True)
class ScheduledSeq:
    request_id: str
    token_ids: list[int]        # tokens whose KV is computed this step (a prompt chunk, or one decode token)
    num_computed_tokens: int    # tokens already in the cache: the position of token_ids[0]
    block_table: list[int]      # physical blocks covering num_computed_tokens + len(token_ids)
    sampling: SamplingRow | None = None   # set when the chunk reaches the last known token: sample one
    # Prompt logprobs: the prompt tokens that follow this chunk's first len(prompt_targets)
    # tokens (their logprobs come from those rows' logits), and how many top alternatives.
    prompt_targets: list[int] | None = None
    prompt_logprobs: int = 0
    pooling: str | None = None      # an embedding request: "mean" pools every row, "last" the prompt's last

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def sample(self) -> bool:
        return self.sampling is not None


@dataclass(slots=True)
class SchedulerOutput:
    step: int
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)   # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)    # (host block, device block)
    swapped_out_ids: list[str] = field(default_factory=list)        # requests whose KV swap_out copies
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    # Structured outputs: allowed-token bitmasks (int32 [rows, ceil(vocab/32)]) for these rows of
    # the sampled sequences (indices among the scheduled sequences that sample, in order).
    grammar_rows: list[int] = field(default_factory=list)
    grammar_bitmask: Any = None

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.swap_out or self.swap_in)

    @property
    def has_swaps(self) -> bool:
        return bool(self.swap_out or self.swap_in)


@dataclass(slots=True)
class ModelOutput:
    """One sampled token per scheduled sequence with ``sampling`` set, in scheduling order."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None] | None = None
    prompt_logprobs: dict[str, list[dict[int, float]]] | None = None   # request id -> this chunk's entries
    pooled: dict[str, Any] | None = None   # request id -> this chunk's summed (mean) or last hidden state
