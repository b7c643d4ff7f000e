"""The messages between a front end and an engine loop: declared types, encoded once.

Commands go down: ``EngineRequest`` (add a validated request's sequences), ``Finish`` (end
sequences: a stop string, a failed sibling, a caller's abort) and ``Shutdown``. Results come up:
``Ready`` or ``StartFailed`` once, then ``StepResults`` after every step (the step's per-sequence
deltas, ``SeqUpdate``, and the stats), ``LoopFailed`` if the loop dies and ``Closed`` when it has
stopped. In one process (``AsyncEngine``) the loop receives the objects themselves; across the
process pipe (``ProcessEngine``, and so every data-parallel replica) each message is one msgpack
frame (msgspec), tagged by its type and decoded straight into these types -- no tuples whose
meaning lives in their position.

Versioning: ``WIRE_VERSION`` changes when a message changes incompatibly (a field removed,
renamed or retyped). The engine process refuses a front end of another version and the front end
refuses an engine process of another (``Ready.wire_version``). A field added with a default is
compatible: an older reader skips fields it does not know. No torch here.
"""

from __future__ import annotations

from typing import Any

import msgspec

from conveyor.core.engine_core import SeqUpdate
from conveyor.core.stats import EngineStats
from conveyor.errors import InvalidRequestError
from conveyor.lora.request import LoRARequest
from conveyor.request import RequestStatus
from conveyor.sampling.params import SamplingParams

WIRE_VERSION = 1


class WireError(RuntimeError):
    """A message that is not one of this version's types, or a peer of another version."""


class EngineRequest(msgspec.Struct, frozen=True, kw_only=True, tag="add"):
    """A validated request as the engine core receives it: one sequence per (seq id, seed)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seq_ids: list[str]
    seeds: list[int]
    priority: int
    arrival_time: float
    cache_salt: str | None = None
    tenant: str = ""                 # who it is served for (fair scheduling per tenant)
    lora: LoRARequest | None = None  # the adapter it runs under (None: the base model)


class Finish(msgspec.Struct, frozen=True, kw_only=True, tag="finish"):
    """End these sequences in the core: a stop string was found (``reason``), a sibling failed, or the
    caller aborted (``report``: the core answers with a finish delta per sequence it ended)."""

    seq_ids: list[str]
    status: RequestStatus = RequestStatus.FINISHED_ABORTED
    reason: int | str | None = None
    report: bool = False


class Shutdown(msgspec.Struct, frozen=True, kw_only=True, tag="shutdown"):
    """Stop the loop once its requests are done, aborting those still unfinished at ``deadline``."""

    deadline: float   # time.monotonic() of the loop's process (same machine)


class Ready(msgspec.Struct, frozen=True, kw_only=True, tag="ready"):
    """The engine process has loaded its model: what the front end needs to know of it."""

    wire_version: int
    model_name: str
    max_model_len: int
    vocab_size: int
    dtype: str
    eos_token_ids: list[int]
    generation_defaults: dict[str, Any]
    stats: EngineStats


class StartFailed(msgspec.Struct, frozen=True, kw_only=True, tag="start_failed"):
    message: str


class StepResults(msgspec.Struct, frozen=True, kw_only=True, tag="step"):
    """One step's deltas (after those the applied commands produced) and the stats at its end."""

    updates: list[SeqUpdate]
    stats: EngineStats
    applied_seqs: int   # sequences of EngineRequests applied before this step (the client's back-pressure)


class LoopFailed(msgspec.Struct, frozen=True, kw_only=True, tag="failed"):
    message: str
    engine_dead: bool   # the core is dead (EngineDeadError), not a failure outside it


class Closed(msgspec.Struct, frozen=True, kw_only=True, tag="closed"):
    """The loop has stopped; nothing follows."""


Command = EngineRequest | Finish | Shutdown
Result = Ready | StartFailed | StepResults | LoopFailed | Closed

_encoder = msgspec.msgpack.Encoder()
_commands = msgspec.msgpack.Decoder(Command)
_results = msgspec.msgpack.Decoder(Result)


def encode(message: Command | Result) -> bytes:
    """One message as one frame. A request whose parameters cannot cross a process (offline-only
    ``logits_processors``, which are callables) is an InvalidRequestError."""
    try:
        return _encoder.encode(message)
    except TypeError as e:
        if isinstance(message, EngineRequest):
            raise InvalidRequestError(f"this request cannot be sent to the engine process: {e}",
                                      "logits_processors" if message.params.logits_processors else None) from e
        raise


def decode_command(frame: bytes) -> Command:
    try:
        return _commands.decode(frame)
    except msgspec.DecodeError as e:   # ValidationError included: an unknown tag or a wrong field
        raise WireError(f"not a command of wire version {WIRE_VERSION}: {e}") from e


def decode_result(frame: bytes) -> Result:
    try:
        return _results.decode(frame)
    except msgspec.DecodeError as e:
        raise WireError(f"not a result of wire version {WIRE_VERSION}: {e}") from e


def check_version(peer: int, who: str) -> None:
    if peer != WIRE_VERSION:
        raise WireError(f"{who} speaks wire version {peer}; this side speaks {WIRE_VERSION}")
