"""The engine's step loop beside an event loop, with a per-request async stream of outputs.

``EngineLoop`` is the loop: only it touches the Engine; callers post commands (add, abort,
stop) to a thread-safe queue, applied between steps, and each step's outputs and stats go to
a sink. ``AsyncEngine`` runs it on a background thread of the server's process: torch releases
the GIL in its kernels, so the event loop (HTTP, tokenization) runs while the model computes.
``ProcessEngine`` (process_engine.py) runs the same loop in a child process. The HTTP layer
only sees the ``EngineClient`` protocol; both clients share the stream bookkeeping here.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from conveyor.config import EngineConfig
from conveyor.engine.core import EngineDeadError
from conveyor.engine.engine import Engine
from conveyor.engine.output_processor import error_output
from conveyor.engine.outputs import RequestOutput
from conveyor.sampling.params import SamplingParams
from conveyor.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# How long the loop waits before retrying when requests exist but nothing could be scheduled.
_STALL_WAIT_S = 0.01


class Overloaded(RuntimeError):
    """Too many requests are queued; the caller should retry later."""


class EngineClient(Protocol):
    """What the HTTP layer needs from an engine, in-process or not."""

    model_name: str
    max_model_len: int
    tokenizer: Tokenizer

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None: ...

    def add_request(self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str,
                    priority: int = 0) -> RequestStream: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> dict[str, Any]: ...

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
    """`new` with its deltas extended back over `old`'s (two consecutive outputs of one request)."""
    for a, b in zip(old.outputs, new.outputs):
        b.delta_text = a.delta_text + b.delta_text
        b.delta_token_ids = a.delta_token_ids + b.delta_token_ids
    return new


# ---- commands: plain data, so that they can cross a process boundary ----------------------------

@dataclass(slots=True)
class Add:
    request_id: str
    prompt: str | list[int] | dict
    params: SamplingParams
    priority: int
    arrival_time: float


@dataclass(slots=True)
class Abort:
    request_id: str


@dataclass(slots=True)
class Stop:
    deadline: float   # time.monotonic() after which unfinished requests are aborted


class LoopSink(Protocol):
    """Where an EngineLoop's results go (a client in this process, or a pipe to one)."""

    def deliver(self, outputs: list[RequestOutput], stats: dict[str, Any], applied_seqs: int) -> None: ...

    def failed(self, error: BaseException) -> None: ...


class EngineLoop:
    """The engine's step loop: commands applied between steps, results handed to a sink."""

    def __init__(self, engine: Engine, sink: LoopSink):
        self.engine = engine
        self.sink = sink
        self._cv = threading.Condition()
        self._commands: deque = deque()
        self._live: set[str] = set()          # request ids added and not yet finished
        self._step_time_total = 0.0

    def post(self, command: Add | Abort | Stop) -> None:
        with self._cv:
            self._commands.append(command)
            self._cv.notify()

    def run(self) -> None:
        """Step until a Stop command's requests are done (or its deadline passed); never raises."""
        stale = False      # counts in the stats lag until a schedule() runs after the last change
        stalled = False    # requests exist but the last step scheduled nothing
        stop: Stop | None = None
        try:
            while True:
                commands, stop = self._wait_for_work(stale, stalled, stop)
                added = self._apply(commands)
                busy = self.engine.has_unfinished_requests()
                if stop is not None and (not busy or time.monotonic() >= stop.deadline):
                    for rid in list(self._live):
                        self.engine.abort_request(rid)
                    self._step(added)
                    return
                if busy or stale or added:
                    stalled = self._step(added) and self.engine.has_unfinished_requests()
                    stale = busy
                if self.engine.dead:   # its requests already failed in the step that killed it
                    raise EngineDeadError(f"the engine stopped: {self.engine.core.dead_reason}")
        except BaseException as e:   # noqa: BLE001 - any failure ends the loop; the streams must hear of it
            if not isinstance(e, EngineDeadError):
                logger.exception("engine loop failed")
            self.sink.failed(e)
        finally:
            try:
                self.engine.save_trace()
            except Exception:   # noqa: BLE001 - a trace that cannot be written must not hide the exit
                logger.exception("could not write the step trace")
            try:
                self.engine.close()
            except Exception:   # noqa: BLE001
                logger.exception("could not stop the tensor-parallel ranks")

    def _wait_for_work(self, stale: bool, stalled: bool, stop: Stop | None) -> tuple[list, Stop | None]:
        with self._cv:
            idle = not self.engine.has_unfinished_requests() and not stale
            if not self._commands and stop is None and (idle or stalled):
                self._cv.wait(timeout=None if idle else _STALL_WAIT_S)
            elif not self._commands and stop is not None and stalled:
                self._cv.wait(timeout=max(0.0, min(_STALL_WAIT_S, stop.deadline - time.monotonic())))
            commands = list(self._commands)
            self._commands.clear()
        for c in commands:
            if isinstance(c, Stop) and (stop is None or c.deadline < stop.deadline):
                stop = c
        return commands, stop

    def _apply(self, commands: list) -> int:
        """Apply queued commands in order; returns the number of sequences added."""
        added, rejected = 0, []
        for c in commands:
            if isinstance(c, Add):
                added += c.params.num_seqs
                try:
                    if c.request_id in self._live:
                        raise ValueError(f"duplicate request id {c.request_id!r}")
                    self.engine.add_request(c.prompt, c.params, c.request_id, c.priority, c.arrival_time)
                    self._live.add(c.request_id)
                except Exception as e:   # noqa: BLE001 - a bad request must not stop the loop
                    rejected.append(error_output(c.request_id, str(e)))
            elif isinstance(c, Abort):
                self.engine.abort_request(c.request_id)
        if rejected:
            self.sink.deliver(rejected, self.engine.stats(), 0)
        return added

    def _step(self, added: int) -> bool:
        """One engine step; hands over outputs and stats. Returns True if it stalled."""
        outputs = self.engine.step()
        self._step_time_total += self.engine.last_step_time
        stats = self.engine.stats()
        stats["step_time_total"] = self._step_time_total   # seconds inside Engine.step(), all steps
        for out in outputs:
            if out.finished:
                self._live.discard(out.request_id)
        self.sink.deliver(outputs, stats, added)
        return not outputs and stats["step_prefill_tokens"] + stats["step_decode_tokens"] == 0


@dataclass(slots=True)
class _Shared:
    """Client-side state, always under StreamingClient._lock."""

    streams: dict[str, RequestStream] = field(default_factory=dict)
    pending_seqs: int = 0       # sequences added but not yet applied by the loop
    stats: dict[str, Any] = field(default_factory=dict)


class StreamingClient:
    """The caller side shared by AsyncEngine and ProcessEngine: streams, back-pressure, health.

    Subclasses set model_name, max_model_len, tokenizer, and implement _post (send a command to
    the loop) and _validate; results arrive through deliver() / failed() (the LoopSink).
    """

    model_name: str
    max_model_len: int
    tokenizer: Tokenizer

    def __init__(self, max_waiting: int | None, stats: dict[str, Any]):
        self.max_waiting = max_waiting
        self._finished_listeners: list[Callable[[RequestOutput], None]] = []
        self._lock = threading.Lock()
        self._shared = _Shared(stats=stats)
        self._accepting = True
        self._error: BaseException | None = None

    # ---- caller side (any thread with a running event loop) -------------------------------
    def add_request(self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str,
                    priority: int = 0) -> RequestStream:
        """Queue a request; raises Overloaded when `max_waiting` sequences already wait."""
        stream = RequestStream(request_id, asyncio.get_running_loop())
        with self._lock:
            if self._error is not None or not self._accepting:
                raise EngineDeadError(_dead_message(self._error))
            s = self._shared
            waiting = s.pending_seqs + s.stats.get("num_waiting", 0)
            if self.max_waiting is not None and waiting >= self.max_waiting:
                raise Overloaded(f"{waiting} sequences are already waiting (limit {self.max_waiting})")
            if request_id in s.streams:
                raise ValueError(f"duplicate request id {request_id!r}")
            s.pending_seqs += params.num_seqs
            s.streams[request_id] = stream
        self._post(Add(request_id, prompt, params, priority, time.monotonic()))
        return stream

    def abort(self, request_id: str) -> None:
        """Abort at any time; applied between steps, the request's KV blocks free at once."""
        self._post(Abort(request_id))

    def stats(self) -> dict[str, Any]:
        """The engine's stats as of the end of the latest step (exact once idle)."""
        with self._lock:
            return dict(self._shared.stats, num_unfinished_requests=len(self._shared.streams))

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
        self._post(Stop(time.monotonic() + timeout))

    def _post(self, command: Add | Abort | Stop) -> None:
        raise NotImplementedError

    # ---- results (LoopSink; called from the loop's side) ---------------------------------------
    def deliver(self, outputs: list[RequestOutput], stats: dict[str, Any], applied_seqs: int) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        with self._lock:
            s = self._shared
            s.pending_seqs -= applied_seqs
            s.stats = stats
            for out in outputs:
                stream = s.streams.pop(out.request_id, None) if out.finished else s.streams.get(out.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._hand_over, items)
            except RuntimeError:   # that loop is closed: nobody is listening any more
                pass

    def failed(self, error: BaseException) -> None:
        """The loop ended with `error`: every open stream gets an error output; no more requests."""
        with self._lock:
            self._error = error
            self._accepting = False
            stats = self._shared.stats
        message = _dead_message(error)
        with self._lock:
            open_ids = list(self._shared.streams)
        self.deliver([error_output(rid, message) for rid in open_ids], stats, 0)

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


class AsyncEngine(StreamingClient):
    """Runs `engine`'s loop on a background thread of this process; see the module docstring."""

    def __init__(self, engine: Engine, max_waiting: int | None = None):
        super().__init__(max_waiting, engine.stats())
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len   # already capped at the KV cache's size
        self._loop = EngineLoop(engine, self)
        self._thread = threading.Thread(target=self._loop.run, name="conveyor-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, max_waiting: int | None = None) -> AsyncEngine:
        return cls(Engine(config), max_waiting)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(prompt_token_ids, params)   # reads only immutable config

    def _post(self, command: Add | Abort | Stop) -> None:
        self._loop.post(command)

    @property
    def is_healthy(self) -> bool:
        """Running and accepting requests (False from the start of a shutdown, or once the engine died)."""
        return self._accepting and self._error is None and self._thread.is_alive()

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting, let in-flight requests finish for up to `timeout` s, abort the rest."""
        self._stop(timeout)
        await asyncio.to_thread(self._thread.join)

    def close(self, timeout: float = 0.0) -> None:
        """Blocking shutdown, for callers without an event loop (outputs still queued are dropped)."""
        self._stop(timeout)
        self._thread.join()


def _dead_message(error: BaseException | None) -> str:
    if error is None:
        return "the engine is shutting down"
    return str(error) if isinstance(error, EngineDeadError) else f"the engine loop failed: {error!r}"
