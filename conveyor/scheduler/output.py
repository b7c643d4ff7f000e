"""The contract between the scheduler and an executor: what to run, and what came out.

Plain data only (ids, token ids, positions, block ids, sampling parameters): an executor never
sees a live ``Request``, so it can live in another process. Each plan carries what changed
since the previous one, as in vLLM v1: a request the runner has not seen (new, resumed after a
recompute preemption) comes once in full (``NewRequestData`` and its whole block table); after
that only its new block ids and this step's tokens come, and the runner keeps the rest
(``conveyor/runner/state.py``); a request swapped back in keeps that state and gets its new
table whole (``replace_table``). ``forget_ids`` tells it whom to drop. Results
name requests by id, never by position. The scheduler does not touch a plan's lists after
handing it over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from conveyor.lora.request import LoRARequest
from conveyor.sampling.params import SamplingParams
from conveyor.sampling.row import SamplingRow  # noqa: F401 - re-exported (the runner's per-request view)


@dataclass(slots=True)
class NewRequestData:
    """What the runner keeps of a request it has not seen, sent once (the history only when the
    sampler or a logit edit reads it: output ids for penalties, bad words and logits processors,
    prompt ids for a repetition penalty)."""

    params: SamplingParams
    seed: int                                  # effective seed: params.seed, or one the engine drew
    num_output_tokens: int                     # generated so far, before this step
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    lora: LoRARequest | None = None            # the adapter its tokens run under (None: the base model)


@dataclass(slots=True)
class ScheduledSeq:
    request_id: str
    token_ids: list[int]        # tokens whose KV is computed this step (a prompt chunk, or one decode token)
    num_computed_tokens: int    # tokens already in the cache: the position of token_ids[0]
    # Block ids to append to the runner's table of this request: the whole table when `new` is
    # set, else those allocated since the last plan that named it (mostly none).
    new_block_ids: list[int]
    new: NewRequestData | None = None   # set when the runner does not hold this request
    replace_table: bool = False         # swapped back in: new_block_ids is its whole (new) table
    sample: bool = False        # the chunk reaches the last known token: sample one
    # Speculative decoding: the last num_drafts of token_ids are proposed, not known: the runner
    # verifies them (a logits row for each position from the known token on) and reports how many
    # it accepted (ModelOutput.accepted); the KV written for refused ones is garbage nobody reads.
    num_drafts: int = 0
    # Prompt logprobs: the prompt tokens that follow this chunk's rows prompt_targets_row ..
    # + len(prompt_targets) (their logprobs come from those rows' logits), and how many top alternatives.
    prompt_targets: list[int] | None = None
    prompt_targets_row: int = 0
    prompt_logprobs: int = 0
    pooling: str | None = None      # an embedding request: "mean" pools every row, "last" the prompt's last
    pool_end: bool = False          # the chunk ends the prompt: return the normalised embedding

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def draft_token_ids(self) -> list[int]:
        """The proposed tokens at the end of token_ids (empty without speculation)."""
        return self.token_ids[len(self.token_ids) - self.num_drafts:]


@dataclass(slots=True)
class SchedulerOutput:
    step: int
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)   # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)    # (host block, device block)
    swapped_out_ids: list[str] = field(default_factory=list)        # requests whose KV swap_out copies
    # Requests the runner must drop before this plan's (finished, aborted, failed, or preempted by
    # recompute since an earlier plan): set only on plans that reach execute().
    forget_ids: list[str] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    # Structured outputs: allowed-token bitmasks (int32 [rows, ceil(vocab/32)]), row i for the
    # sampling request grammar_ids[i].
    grammar_ids: list[str] = field(default_factory=list)
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


class LogprobEntry(msgspec.Struct, array_like=True):
    """One position's logprobs: the top-k alternatives and the target token (the sampled one, or
    the prompt token), with the target's exact rank under the raw logits (1 = most likely) --
    which the dict alone cannot tell when the target is outside the top-k. Crosses the process pipe
    (core/wire.py) as [logprobs, token_id, rank]."""

    logprobs: dict[int, float]
    token_id: int
    rank: int


@dataclass(slots=True)
class ModelOutput:
    """What a step produced, keyed by request id (rows may come in any order)."""

    sampled: dict[str, int] = field(default_factory=dict)   # request id -> its token, for each ``sample`` seq
    logprobs: dict[str, LogprobEntry] | None = None        # request id -> the sampled token's entry
    prompt_logprobs: dict[str, list[LogprobEntry]] | None = None   # request id -> this chunk's entries
    embeddings: dict[str, list[float]] | None = None   # request id -> its normalised embedding (prompt done)
    # Speculative decoding, for each seq with num_drafts: how many of its drafts were accepted (in
    # order; missing: none) and their logprob entries (params.logprobs). The sampled token follows them.
    accepted: dict[str, int] | None = None
    draft_logprobs: dict[str, list[LogprobEntry]] | None = None

    def num_accepted(self, request_id: str) -> int:
        return (self.accepted or {}).get(request_id, 0)

    def step_tokens(self, seq: ScheduledSeq) -> list[int]:
        """A sampling seq's new tokens of the step, in order: its accepted drafts, then the sampled one."""
        return seq.draft_token_ids[:self.num_accepted(seq.request_id)] + [self.sampled[seq.request_id]]
