"""What an executor keeps of each request between steps, rebuilt from the plans' deltas.

The scheduler sends a request in full once (``ScheduledSeq.new``: params, seed, the history the
sampler needs, its whole block table) and then only what changed (new block ids, this step's
tokens); ``forget_ids`` drops it. Applying every plan in order keeps, per request, its block
table, its sampling parameters and how many tokens it has generated, so that a step costs what
changed, not how long the requests have run. Every tensor-parallel rank applies the same plans
and holds the same state; the simulator and the tests' fake executors use this module too.
No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conveyor.lora.request import LoRARequest
from conveyor.sampling.row import SamplingRow
from conveyor.scheduler.output import NewRequestData, ScheduledSeq, SchedulerOutput


@dataclass(slots=True)
class RequestState:
    block_ids: list[int]        # its block table: position p lives in block_ids[p // block_size]
    sampling: SamplingRow       # params, seed, outputs so far, the history the sampler reads
    num_computed_tokens: int    # where its next chunk must start
    # It sampled in its latest step: the token the scheduler appended is the first token of its
    # next chunk, where the history and the output count pick it up.
    pending_sample: bool = False
    pooled: Any = None          # an embedding request: the running sum (mean) of its pooled rows so far
    # Speculative decoding: the drafts its latest step verified, until their outcome is taken in
    # (``accept``, or the next plan's start position: see ``_take``).
    drafts: list[int] | None = None
    lora: LoRARequest | None = None   # the adapter its tokens run under (None: the base model)


class StateError(RuntimeError):
    """A plan that does not follow from the state it is applied to (a delta for an unknown request,
    a chunk that does not start where the last one ended): the runner would read the wrong KV."""


class RunnerState:
    def __init__(self) -> None:
        self.requests: dict[str, RequestState] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def apply(self, plan: SchedulerOutput) -> None:
        """Bring the state up to this plan: drop ``forget_ids`` first (an id may come back as new
        in the same plan), then take each scheduled request's full data or delta."""
        self.forget(plan.forget_ids)
        for seq in plan.scheduled:
            self._take(seq)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.requests.pop(rid, None)

    def _take(self, seq: ScheduledSeq) -> None:
        if seq.new is not None:
            state = RequestState(list(seq.new_block_ids), _row(seq.new), seq.num_computed_tokens, lora=seq.new.lora)
            self.requests[seq.request_id] = state
        else:
            state = self.requests.get(seq.request_id)
            if state is None:
                raise StateError(f"a delta for request {seq.request_id!r}, which the runner does not hold")
            if state.drafts is not None:   # its drafts' outcome, from where this chunk starts
                refused = state.num_computed_tokens - seq.num_computed_tokens
                if not 0 <= refused <= len(state.drafts):
                    raise StateError(f"request {seq.request_id!r}: chunk at {seq.num_computed_tokens} after "
                                     f"{len(state.drafts)} drafts ending at {state.num_computed_tokens}")
                _accepted(state, len(state.drafts) - refused)
            if seq.num_computed_tokens != state.num_computed_tokens:
                raise StateError(f"request {seq.request_id!r}: chunk at {seq.num_computed_tokens}, the runner "
                                 f"expected {state.num_computed_tokens}")
            if seq.replace_table:   # swapped back in: other device blocks, same tokens
                state.block_ids = list(seq.new_block_ids)
            else:
                state.block_ids.extend(seq.new_block_ids)
            if state.pending_sample:
                _took_sample(state.sampling, seq.token_ids[0])
        state.pending_sample = seq.sample
        state.num_computed_tokens = seq.num_computed_tokens + seq.num_tokens
        state.drafts = seq.draft_token_ids if seq.num_drafts else None

    def accept(self, request_id: str, accepted: int) -> None:
        """Speculative decoding: of the latest step's drafts, the first `accepted` were verified
        (they join the output, the sampled token follows them); the KV written for the rest is not
        part of the sequence, and the next chunk starts after the accepted ones. An executor that
        verifies calls this; one that does not (another tensor-parallel rank) learns the outcome
        from where the request's next chunk starts."""
        state = self.requests[request_id]
        if state.drafts is not None:
            _accepted(state, accepted)

    def block_table(self, request_id: str) -> list[int]:
        return self.requests[request_id].block_ids

    def row(self, request_id: str) -> SamplingRow:
        return self.requests[request_id].sampling


def _row(new: NewRequestData) -> SamplingRow:
    """The runner's own copy: it appends to the output history, which must not be the scheduler's list."""
    outputs = None if new.output_token_ids is None else list(new.output_token_ids)
    return SamplingRow(new.params, new.seed, new.num_output_tokens, new.prompt_token_ids, outputs)


def _accepted(state: RequestState, accepted: int) -> None:
    drafts, state.drafts = state.drafts, None
    state.num_computed_tokens -= len(drafts) - accepted
    for token in drafts[:accepted]:
        _took_sample(state.sampling, token)


def _took_sample(row: SamplingRow, token: int) -> None:
    row.num_output_tokens += 1
    if row.output_token_ids is not None:
        row.output_token_ids.append(token)
