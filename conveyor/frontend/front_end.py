"""The front end of one engine: requests in (validated once), core deltas out as RequestOutputs.

It lives in the caller's process -- the server's for ``conveyor serve`` (the engine core runs in
a child process), the caller's for ``LLM`` -- and owns what a caller sees: input processing
(inputs.py), the ``n`` sibling sequences of a request, their seeds, detokenization, stop strings
and the response shapes (output_processor.py). The core receives an ``EngineRequest`` (plain,
validated data) and sends back per-sequence deltas (``SeqUpdate``: the new token ids, their
logprobs, a finish); nothing already sent crosses again. A stop string found here ends the
sequence in the core through the abort path (``Finish`` with the stop string as reason).
No torch here.
"""

from __future__ import annotations

import numbers
import random

from conveyor.core.engine_core import SeqUpdate
from conveyor.frontend.inputs import InputProcessor, InvalidRequestError, ProcessedRequest
from conveyor.frontend.output_processor import OutputProcessor
from conveyor.frontend.outputs import RequestOutput
from conveyor.core.wire import EngineRequest, Finish
from conveyor.sampling.params import SamplingParams


class FrontEnd:
    """Input processing and output processing of one engine core; see the module docstring."""

    def __init__(self, inputs: InputProcessor, seed: int | None = None):
        self.inputs = inputs
        self.tokenizer = inputs.tokenizer
        self.outputs = OutputProcessor(inputs.tokenizer)
        self._rng = random.Random(seed)
        self._next_id = 0
        self._next_seq = 0

    def new_request_id(self) -> str:
        self._next_id += 1
        return str(self._next_id - 1)

    def register(self, prompt: str | list[int] | dict | ProcessedRequest, params: SamplingParams | None,
                 request_id: str | None, priority: int, arrival_time: float) -> EngineRequest:
        """Register a request, processing it first unless it is a ProcessedRequest; raises InvalidRequestError."""
        inp = prompt if isinstance(prompt, ProcessedRequest) else self.inputs.process(prompt, params)
        if not (isinstance(priority, numbers.Integral) and not isinstance(priority, bool)):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}", "priority")
        request_id = request_id if request_id is not None else self.new_request_id()
        if request_id in self.outputs:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        p = inp.params
        seeds = [p.seed + i if p.seed is not None else self._rng.getrandbits(63) for i in range(p.num_seqs)]
        seq_ids = []
        for _ in seeds:
            self._next_seq += 1
            seq_ids.append(f"seq-{self._next_seq}")
        self.outputs.add(request_id, inp.prompt, inp.prompt_token_ids, p, seq_ids, arrival_time)
        return EngineRequest(request_id=request_id, prompt_token_ids=inp.prompt_token_ids, params=p,
                             seq_ids=seq_ids, seeds=seeds, priority=int(priority), arrival_time=arrival_time,
                             cache_salt=inp.cache_salt, tenant=inp.tenant, lora=inp.lora)

    def forget(self, request_id: str) -> None:
        """Drop a registered request that never reached the core (its add failed)."""
        self.outputs.abort(request_id, report=False)

    def live_seq_ids(self, request_id: str) -> list[str]:
        """The sequences of a request that have not finished here (what an abort must end in the core)."""
        return self.outputs.live_seq_ids(request_id)

    def abort(self, request_id: str, report: bool = True) -> list[str]:
        """Mark a request aborted; returns the ids of its live sequences, which the core must abort."""
        return self.outputs.abort(request_id, report)

    def process(self, updates: list[SeqUpdate]) -> tuple[list[RequestOutput], list[Finish]]:
        """The outputs of the requests that changed, and the sequences the core must end."""
        return self.outputs.process(updates)

    def has_unfinished(self) -> bool:
        return self.outputs.has_unfinished()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.outputs
