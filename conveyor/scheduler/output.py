"""The contract between the scheduler and an executor: what to run, and what came out."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.request import Request


@dataclass(slots=True)
class ScheduledSeq:
    request: Request
    num_tokens: int          # tokens computed this step, starting at request.num_computed_tokens
    block_table: list[int]
    sample: bool             # this chunk reaches the end of the known tokens: sample the next one


@dataclass(slots=True)
class SchedulerOutput:
    step: int
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)   # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)    # (host block, device block)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.swap_out or self.swap_in)


@dataclass(slots=True)
class ModelOutput:
    """One sampled token per scheduled sequence with ``sample=True``, in scheduling order."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None] | None = None
