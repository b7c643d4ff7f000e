"""The caller's side of an engine, whatever carries its commands: ``EngineClient`` (what the HTTP
layer needs), the per-request async ``RequestStream`` and ``StreamingClient``, the front end that the
in-process thread and the child process transports share (transport/): it processes and registers
requests, turns the loop's deltas into outputs (detokenization, stop strings, ``n`` siblings) and
hands them to the streams, with back-pressure and health. No torch here.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from conveyor.core.engine_core import EngineDeadError, SeqUpdate
from conveyor.core.stats import EngineStats
from conveyor.core.wire import Command, Finish, Shutdown
from conveyor.frontend.front_end import FrontEnd
from conveyor.frontend.inputs import InputProcessor, ProcessedRequest
from conveyor.frontend.output_processor import error_output
from conveyor.frontend.outputs import RequestOutput
from conveyor.sampling.params import SamplingParams
from conveyor.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class Overloaded(RuntimeError):
    """Too many requests are queued; the caller should retry later."""


class EngineClient(Protocol):
    """What the HTTP layer needs from an engine, in-process or not."""

    model_name: str
    max_model_len: int
    tokenizer: Tokenizer
    generation_defaults: dict   # the model's default sampling fields (conveyor/sampling/defaults.py)
    inputs: InputProcessor      # every check a request gets, in the caller's process (frontend/inputs.py)

    def add_request(self, prompt: str | list[int] | dict | ProcessedRequest, params: SamplingParams | None,
                    request_id: str, priority: int = 0) -> RequestStream: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def add_finished_listener(self, listener: Callable[[RequestOutput], None]) -> None: ...

    @property
    def is_healthy(self) -> bool: ...

    @property
    def dead_reason(self) -> str | None: ...

    async def shutdown(self, timeout: float = 30.0) -> None: ...


class RequestStream:
    """Async iterator of one request's outputs; ends after the finished one.

    Outputs that pile up while the consumer is busy are merged into one (deltas concatenated,
    cumulative fields from the latest), so a slow consumer does less work, not more.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.loop = loop
        self.finished = False
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    def put(self, output: RequestOutput) -> None:
        self._queue.put_nowait(output)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self._queue.get()
        while not out.finished and not self._queue.empty():
            out = merge_outputs(out, self._queue.get_nowait())
        self.finished = out.finished
        return out


def merge_outputs(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """`new` with its deltas extended back over `old`'s (two consecutive outputs of one request, both
    the consumer's own)."""
    for a, b in zip(old.outputs, new.outputs):
        b.delta_text = a.delta_text + b.delta_text
        b.delta_token_ids = a.delta_token_ids + b.delta_token_ids
        if b.delta_logprobs is not None:
            b.delta_logprobs = (a.delta_logprobs or ()) + b.delta_logprobs
    return new


@dataclass(slots=True)
class _Shared:
    """Client-side state, always under StreamingClient._lock."""

    streams: dict[str, RequestStream] = field(default_factory=dict)
    pending_seqs: int = 0       # sequences added but not yet applied by the loop
    stats: EngineStats = field(default_factory=EngineStats)


class StreamingClient:
    """The front end shared by AsyncEngine and ProcessEngine: requests validated and registered
    here, the loop's deltas turned into outputs here, streams, back-pressure, health.

    Subclasses set model_name, max_model_len, and implement _post (send a command to the loop);
    results arrive through deliver() / failed() (the LoopSink): in the receiving thread, so
    with ProcessEngine the front end's work overlaps the engine process's next step.
    """

    model_name: str
    max_model_len: int
    generation_defaults: dict

    def __init__(self, max_waiting: int | None, stats: EngineStats, frontend: FrontEnd):
        self.max_waiting = max_waiting
        self.frontend = frontend
        self.tokenizer: Tokenizer = frontend.tokenizer
        self.inputs: InputProcessor = frontend.inputs
        self._finished_listeners: list[Callable[[RequestOutput], None]] = []
        self._lock = threading.Lock()
        self._shared = _Shared(stats=stats)
        self._accepting = True
        self._error: BaseException | None = None

    # ---- caller side (any thread with a running event loop) -------------------------------
    def add_request(self, prompt: str | list[int] | dict | ProcessedRequest, params: SamplingParams | None,
                    request_id: str, priority: int = 0) -> RequestStream:
        """Queue a request; raises InvalidRequestError if it cannot run (a ProcessedRequest, from
        ``inputs.process``, is not checked again), Overloaded when `max_waiting` sequences already wait."""
        if not isinstance(prompt, ProcessedRequest):   # tokenization: outside the lock
            prompt = self.inputs.process(prompt, params)
        stream = RequestStream(request_id, asyncio.get_running_loop())
        with self._lock:
            if self._error is not None or not self._accepting:
                raise EngineDeadError(_dead_message(self._error))
            s = self._shared
            waiting = s.pending_seqs + s.stats.num_waiting
            if self.max_waiting is not None and waiting >= self.max_waiting:
                raise Overloaded(f"{waiting} sequences are already waiting (limit {self.max_waiting})")
            req = self.frontend.register(prompt, None, request_id, priority, time.monotonic())
            try:
                self._post(req)   # under the lock: an abort or a Shutdown from another thread comes after it
            except BaseException:   # it could not be sent (InvalidRequestError: it cannot cross to the engine)
                self.frontend.forget(request_id)
                raise
            s.pending_seqs += len(req.seq_ids)
            s.streams[request_id] = stream
        return stream

    def abort(self, request_id: str) -> None:
        """Abort at any time: applied between steps, where the sequences' KV blocks free at once; the
        stream ends with the core's answer, so the stats it sees then already count the abort."""
        with self._lock:
            seq_ids = self.frontend.live_seq_ids(request_id)
        if seq_ids:
            self._post(Finish(seq_ids=seq_ids, report=True))

    def stats(self) -> EngineStats:
        """The engine's stats as of the end of the latest step (exact once idle)."""
        with self._lock:
            return self._shared.stats.replace(num_unfinished_requests=len(self._shared.streams))

    def add_finished_listener(self, listener: Callable[[RequestOutput], None]) -> None:
        """Call `listener` (on the request's event loop) with every finished output, read or not."""
        self._finished_listeners.append(listener)

    @property
    def dead_reason(self) -> str | None:
        """Why the engine stopped serving (None while it serves or after a clean shutdown)."""
        return None if self._error is None else str(self._error)

    def _stop(self, timeout: float) -> None:
        with self._lock:
            self._accepting = False
        self._post(Shutdown(deadline=time.monotonic() + timeout))

    def _post(self, command: Command) -> None:
        """Send a command to the loop. Raises only if this command can never be sent (the request is
        then refused); a loop that is gone is reported through failed()."""
        raise NotImplementedError

    # ---- results (LoopSink; called from the loop's side) ---------------------------------------
    def deliver(self, updates: list[SeqUpdate], stats: EngineStats, applied_seqs: int) -> None:
        """A step's deltas: outputs to their streams; sequences the front end ended go back to the loop."""
        with self._lock:
            s = self._shared
            s.pending_seqs -= applied_seqs
            s.stats = stats
            outputs, finishes = self.frontend.process(updates)
            items = self._route(outputs)
        for command in finishes:
            self._post(command)
        self._hand_over_all(items)

    def _route(self, outputs: list[RequestOutput]) -> dict[asyncio.AbstractEventLoop, list]:
        """(stream, output) pairs by event loop; a finished output closes its stream. Under the lock."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        streams = self._shared.streams
        for out in outputs:
            stream = streams.pop(out.request_id, None) if out.finished else streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, out))
        return by_loop

    def _hand_over_all(self, by_loop: dict[asyncio.AbstractEventLoop, list]) -> None:
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._hand_over, items)
            except RuntimeError:   # that loop is closed: nobody is listening any more
                pass

    def failed(self, error: BaseException) -> None:
        """The loop ended with `error`: every open stream gets an error output; no more requests."""
        message = _dead_message(error)
        with self._lock:
            self._error = error
            self._accepting = False
            open_ids = list(self._shared.streams)
            for rid in open_ids:
                self.frontend.abort(rid, report=False)
            items = self._route([error_output(rid, message) for rid in open_ids])
        self._hand_over_all(items)

    def _hand_over(self, items: list[tuple[RequestStream, RequestOutput]]) -> None:
        """Runs on the caller's event loop."""
        for stream, out in items:
            stream.put(out)
            if out.finished:
                for listener in self._finished_listeners:
                    try:
                        listener(out)
                    except Exception:   # noqa: BLE001 - metrics must not break delivery
                        logger.exception("finished-request listener failed")


def _dead_message(error: BaseException | None) -> str:
    if error is None:
        return "the engine is shutting down"
    return str(error) if isinstance(error, EngineDeadError) else f"the engine loop failed: {error!r}"
