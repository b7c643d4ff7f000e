"""The engine's step loop beside an event loop, with a per-request async stream of outputs.

``EngineLoop`` is the loop: only it touches the ``EngineBackend`` (the model and the engine
core); callers post commands (add a validated request, finish sequences, stop) to a
thread-safe queue, applied between steps, and each step's per-sequence deltas and stats go to
a sink. The caller's side, ``StreamingClient``, is the front end: it validates and registers
requests, turns the deltas into outputs (detokenization, stop strings, ``n`` siblings) and
hands them to the request streams. ``AsyncEngine`` runs the loop on a background thread of the
server's process; ``ProcessEngine`` (process_engine.py) runs it in a child process, where the
front end's work overlaps the next forward pass. The HTTP layer only sees the
``EngineClient`` protocol.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

from conveyor.config import EngineConfig
from conveyor.engine.core import EngineDeadError, SeqUpdate
from conveyor.engine.engine import Engine, EngineBackend
from conveyor.engine.frontend import FrontEnd
from conveyor.engine.inputs import InputProcessor, ProcessedRequest
from conveyor.engine.output_processor import error_output
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.stats import EngineStats
from conveyor.engine.wire import Command, EngineRequest, Finish, Shutdown
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
    generation_defaults: dict   # the model's default sampling fields (conveyor/sampling/defaults.py)
    inputs: InputProcessor      # every check a request gets, in the caller's process (engine/inputs.py)

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


class LoopSink(Protocol):
    """Where an EngineLoop's results go (a client in this process, or a pipe to one)."""

    def deliver(self, updates: list[SeqUpdate], stats: EngineStats, applied_seqs: int) -> None: ...

    def failed(self, error: BaseException) -> None: ...


class EngineLoop:
    """The engine's step loop: commands applied between steps, results handed to a sink."""

    def __init__(self, engine: EngineBackend, sink: LoopSink):
        self.engine = engine
        self.sink = sink
        self._cv = threading.Condition()
        self._commands: deque = deque()
        self._step_time_total = 0.0

    def post(self, command: Command) -> None:
        with self._cv:
            self._commands.append(command)
            self._cv.notify()

    def run(self) -> None:
        """Step until a Shutdown's requests are done (or its deadline passed); never raises."""
        stale = False      # counts in the stats lag until a schedule() runs after the last change
        stalled = False    # requests exist but the last step scheduled nothing
        stop: Shutdown | None = None
        try:
            while True:
                commands, stop = self._wait_for_work(stale, stalled, stop)
                added, updates = self._apply(commands)
                busy = self.engine.has_unfinished()
                if stop is not None and (not busy or time.monotonic() >= stop.deadline):
                    self._step(added, updates + self._abort_all())
                    return
                if busy or stale or added or updates:
                    stalled = self._step(added, updates) and self.engine.has_unfinished()
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

    def _wait_for_work(self, stale: bool, stalled: bool, stop: Shutdown | None) -> tuple[list, Shutdown | None]:
        with self._cv:
            idle = not self.engine.has_unfinished() and not stale
            if not self._commands and stop is None and (idle or stalled):
                self._cv.wait(timeout=None if idle else _STALL_WAIT_S)
            elif not self._commands and stop is not None and stalled:
                self._cv.wait(timeout=max(0.0, min(_STALL_WAIT_S, stop.deadline - time.monotonic())))
            commands = list(self._commands)
            self._commands.clear()
        for c in commands:
            if isinstance(c, Shutdown) and (stop is None or c.deadline < stop.deadline):
                stop = c
        return commands, stop

    def _apply(self, commands: list) -> tuple[int, list[SeqUpdate]]:
        """Apply queued commands in order; returns the number of sequences added and the deltas the
        commands produced (errors of the requests the core refused, the callers' aborts)."""
        added, rejected = 0, []
        for c in commands:
            if isinstance(c, EngineRequest):
                added += len(c.seq_ids)
                try:
                    self.engine.add(c)
                except Exception as e:   # noqa: BLE001 - a bad request must not stop the loop
                    rejected += [SeqUpdate(sid, None, None, "error", None, str(e), None) for sid in c.seq_ids]
            elif isinstance(c, Finish):
                rejected += self.engine.finish(c)
        return added, rejected

    def _abort_all(self) -> list[SeqUpdate]:
        """Shutdown: abort every live sequence; their deltas say so."""
        return self.engine.finish(Finish(seq_ids=list(self.engine.core.scheduler.requests), report=True))

    def _step(self, added: int, extra: list[SeqUpdate]) -> bool:
        """One engine step; hands over its deltas (after `extra`) and the stats. Returns True if it stalled."""
        updates = self.engine.run_step()
        self._step_time_total += self.engine.last_step_time
        stats = self.engine.stats().replace(step_time_total=self._step_time_total)   # seconds in step(), all steps
        self.sink.deliver(extra + updates if extra else updates, stats, added)
        return not updates and stats.step_tokens == 0


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


class AsyncEngine(StreamingClient):
    """Runs `engine`'s loop on a background thread of this process; see the module docstring."""

    def __init__(self, engine: Engine, max_waiting: int | None = None):
        super().__init__(max_waiting, engine.stats(), engine.frontend)
        self.engine = engine
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len   # already capped at the KV cache's size
        self.generation_defaults = engine.generation_defaults
        self._loop = EngineLoop(engine, self)
        self._thread = threading.Thread(target=self._loop.run, name="conveyor-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, max_waiting: int | None = None) -> AsyncEngine:
        return cls(Engine(config), max_waiting)

    def _post(self, command: Command) -> None:
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
