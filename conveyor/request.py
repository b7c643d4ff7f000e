"""A request's state machine and bookkeeping. No tensors here."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from conveyor.lora.request import LoRARequest
from conveyor.sampling.params import SamplingParams


class RequestStatus(Enum):
    WAITING = "waiting"          # queued, never run or preempted by recompute (holds no blocks)
    RUNNING = "running"
    SWAPPED = "swapped"          # preempted by swap: its KV lives in the host pool
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
             RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR}


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    preemption_times: list[float] = field(default_factory=list)   # when each preemption happened (same clock)
    num_cached_tokens: int = 0   # prompt tokens read from the prefix cache when it was first admitted

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @staticmethod
    def merged(metrics: list[RequestMetrics]) -> RequestMetrics | None:
        """One timeline for several sequences (n > 1, several prompts): the earliest arrival, scheduling
        and first token, the latest last token and finish; preemptions of all of them."""
        if not metrics:
            return None

        def first(name: str) -> float | None:
            values = [getattr(m, name) for m in metrics if getattr(m, name) is not None]
            return min(values) if values else None

        def last(name: str) -> float | None:
            values = [getattr(m, name) for m in metrics if getattr(m, name) is not None]
            return max(values) if values else None

        return RequestMetrics(first("arrival_time"), first("first_scheduled_time"), first("first_token_time"),
                              last("last_token_time"), last("finished_time"),
                              num_preemptions=sum(m.num_preemptions for m in metrics),
                              preemption_times=sorted(t for m in metrics for t in m.preemption_times))


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int = 0                         # effective sampling seed
    priority: int = 0                     # lower runs first
    arrival_time: float | None = None     # None: the scheduler stamps it with its clock on arrival
    max_model_len: int | None = None      # hard cap on prompt + output
    prefill_leader: Request | None = None  # n > 1: wait for this sibling's prefill to share its blocks
    cache_salt: str | None = None         # prefix-cache blocks are shared only among requests with this salt
    lora: LoRARequest | None = None       # the LoRA adapter it runs under (None: the base model)
    tenant: str = ""                      # who it is served for (fair scheduling: scheduler/fairness.py)
    status: RequestStatus = RequestStatus.WAITING
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None              # why it finished with FINISHED_ERROR
    arrival_seq: int = 0                  # FCFS tie-break, kept across preemptions
    resumed_step: int = -1                # step at which it last (re)entered RUNNING
    swapped_in_step: int = -1             # step at which it was last swapped back in
    preempted_step: int = -1              # step at which it was last preempted
    grammar: Any = None                   # structured outputs: this sequence's llguidance matcher
    grammar_ended: bool = False           # its grammar is complete or refused a token (sampling/structured.py)
    grammar_end: int | None = None        # ... after this many output tokens (None: after the latest)
    prompt_logprobs: list | None = None   # params.prompt_logprobs: one entry per prompt token so far
    spec_state: Any = None   # speculative decoding: the proposer's per-request state (conveyor/spec/proposers.py)
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.metrics = RequestMetrics(self.arrival_time)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = first_prompt_logprobs(self)

    @property
    def cacheable_prefix(self) -> int | None:
        """Leading tokens whose KV may come from the prefix cache (None: any). Mean pooling needs every
        prompt row computed; a prompt logprob still wanted, the logits of the position before it
        (unless a cached block kept the entry: kv/prefix_cache.py)."""
        if self.params.pooling == "mean":
            return 0
        if self.prompt_logprobs_pending:
            return self.prompt_logprobs_from - 1
        return None

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Prompt logprobs asked for and not all computed yet."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def prompt_logprobs_from(self) -> int:
        """The first prompt token with a logprob (the first token has none; prompt_logprobs_last: fewer)."""
        last = self.params.prompt_logprobs_last
        return 1 if last is None else max(1, self.num_prompt_tokens - last)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def max_tokens(self) -> int:
        """Output-token cap: the params' max_tokens, bounded by the model's context."""
        room = (self.max_model_len or 1 << 62) - self.num_prompt_tokens
        return min(self.params.max_tokens or room, room)

    @property
    def is_finished(self) -> bool:
        return self.status.finished


    def append_token(self, token_id: int, now: float, timed: bool = True) -> None:
        """(timed=False: a later token of the same step, speculative decoding's: the step's one
        inter-token latency is already recorded, as vLLM records one per step)"""
        self.all_token_ids.append(token_id)
        m = self.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        elif timed:
            m.inter_token_latencies.append(now - m.last_token_time)
        m.last_token_time = now

    def finish(self, status: RequestStatus, now: float, reason: int | str | None = None) -> None:
        assert status.finished
        self.status = status
        self.finish_reason = status.value
        self.stop_reason = reason
        self.metrics.finished_time = now


def first_prompt_logprobs(req: Request) -> list:
    """A prompt-logprob list before any chunk ran: None for every token without a logprob wanted."""
    return [None] * min(req.prompt_logprobs_from, req.num_prompt_tokens)
