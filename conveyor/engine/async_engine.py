"""The engine's step loop on a background thread, with a per-request async stream of outputs.

Only the engine thread touches the Engine: callers post commands (add, abort, stop) to a
thread-safe queue and get RequestOutputs back through an asyncio.Queue per request, fed with
``loop.call_soon_threadsafe`` once per step. Torch releases the GIL in its kernels, so the
event loop (HTTP, tokenization) runs while the model computes. The HTTP layer only sees the
``EngineClient`` protocol, so the loop could later move to its own process.
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


@dataclass(slots=True)
class _Add:
    stream: RequestStream
    prompt: str | list[int] | dict
    params: SamplingParams
    priority: int
    arrival_time: float


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Stop:
    deadline: float   # time.monotonic() after which unfinished requests are aborted


@dataclass(slots=True)
class _Shared:
    """State both threads touch, always under AsyncEngine._cv."""

    commands: deque = field(default_factory=deque)
    pending_seqs: int = 0       # sequences added but not yet seen by a schedule()
    stats: dict[str, Any] = field(default_factory=dict)
    num_unfinished: int = 0     # requests with an open stream


class AsyncEngine:
    """Runs `engine` on a background thread; see the module docstring."""

    def __init__(self, engine: Engine, max_waiting: int | None = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len   # already capped at the KV cache's size
        self.max_waiting = max_waiting
        self._finished_listeners: list[Callable[[RequestOutput], None]] = []
        self._cv = threading.Condition()
        self._shared = _Shared(stats=engine.stats())
        self._accepting = True
        self._error: BaseException | None = None
        self._streams: dict[str, RequestStream] = {}   # engine thread only
        self._step_time_total = 0.0                      # engine thread only
        self._thread = threading.Thread(target=self._run, name="conveyor-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, max_waiting: int | None = None) -> AsyncEngine:
        return cls(Engine(config), max_waiting)

    # ---- caller side (any thread with a running event loop) -------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(prompt_token_ids, params)   # reads only immutable config

    def add_request(self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str,
                    priority: int = 0) -> RequestStream:
        """Queue a request; raises Overloaded when `max_waiting` sequences already wait."""
        stream = RequestStream(request_id, asyncio.get_running_loop())
        with self._cv:
            if self._error is not None or not self._accepting:
                raise EngineDeadError(_dead_message(self._error))
            s = self._shared
            waiting = s.pending_seqs + s.stats.get("num_waiting", 0)
            if self.max_waiting is not None and waiting >= self.max_waiting:
                raise Overloaded(f"{waiting} sequences are already waiting (limit {self.max_waiting})")
            s.pending_seqs += params.n
            s.num_unfinished += 1
            s.commands.append(_Add(stream, prompt, params, priority, time.monotonic()))
            self._cv.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Abort at any time; applied between steps, the request's KV blocks free at once."""
        self._post(_Abort(request_id))

    def stats(self) -> dict[str, Any]:
        """Engine.stats() as of the end of the latest step (exact once idle)."""
        with self._cv:
            return dict(self._shared.stats, num_unfinished_requests=self._shared.num_unfinished)

    def add_finished_listener(self, listener: Callable[[RequestOutput], None]) -> None:
        """Call `listener` (on the request's event loop) with every finished output, read or not."""
        self._finished_listeners.append(listener)

    @property
    def is_healthy(self) -> bool:
        """Running and accepting requests (False from the start of a shutdown, or once the engine died)."""
        return self._accepting and self._error is None and self._thread.is_alive()

    @property
    def dead_reason(self) -> str | None:
        """Why the engine stopped serving (None while it serves or after a clean shutdown)."""
        return None if self._error is None else str(self._error)

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting, let in-flight requests finish for up to `timeout` s, abort the rest."""
        self._stop(timeout)
        await asyncio.to_thread(self._thread.join)

    def close(self, timeout: float = 0.0) -> None:
        """Blocking shutdown, for callers without an event loop (outputs still queued are dropped)."""
        self._stop(timeout)
        self._thread.join()

    def _stop(self, timeout: float) -> None:
        with self._cv:
            self._accepting = False
        self._post(_Stop(time.monotonic() + timeout))

    def _post(self, command: object) -> None:
        with self._cv:
            self._shared.commands.append(command)
            self._cv.notify()

    # ---- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        stale = False      # counts in stats() lag until a schedule() runs after the last change
        stalled = False    # requests exist but the last step scheduled nothing
        stop: _Stop | None = None
        try:
            while True:
                commands, stop = self._wait_for_work(stale, stalled, stop)
                added = self._apply(commands)
                busy = self.engine.has_unfinished_requests()
                if stop is not None and (not busy or time.monotonic() >= stop.deadline):
                    self._abort_all()
                    self._step(added)
                    return
                if busy or stale or added:
                    stalled = self._step(added) and self.engine.has_unfinished_requests()
                    stale = busy
                if self.engine.dead:   # its requests already failed in the step that killed it
                    raise EngineDeadError(f"the engine stopped: {self.engine.core.dead_reason}")
        except BaseException as e:   # noqa: BLE001 - any failure ends the loop; streams must hear of it
            if not isinstance(e, EngineDeadError):
                logger.exception("engine loop failed")
            with self._cv:
                self._error = e
                self._accepting = False
            self._fail_all(e)
        finally:
            try:
                self.engine.save_trace()
            except Exception:   # noqa: BLE001 - a trace that cannot be written must not hide the exit
                logger.exception("could not write the step trace")

    def _wait_for_work(self, stale: bool, stalled: bool, stop: _Stop | None) -> tuple[list, _Stop | None]:
        with self._cv:
            s = self._shared
            idle = not self.engine.has_unfinished_requests() and not stale
            if not s.commands and stop is None and (idle or stalled):
                self._cv.wait(timeout=None if idle else _STALL_WAIT_S)
            elif not s.commands and stop is not None and stalled:
                self._cv.wait(timeout=max(0.0, min(_STALL_WAIT_S, stop.deadline - time.monotonic())))
            commands = list(s.commands)
            s.commands.clear()
        for c in commands:
            if isinstance(c, _Stop) and (stop is None or c.deadline < stop.deadline):
                stop = c
        return commands, stop

    def _apply(self, commands: list) -> int:
        """Apply queued commands in order; returns the number of sequences added."""
        added = 0
        for c in commands:
            if isinstance(c, _Add):
                added += c.params.n
                rid = c.stream.request_id
                try:
                    if rid in self._streams:
                        raise ValueError(f"duplicate request id {rid!r}")
                    self.engine.add_request(c.prompt, c.params, rid, c.priority, c.arrival_time)
                    self._streams[rid] = c.stream
                except Exception as e:   # noqa: BLE001 - a bad request must not stop the loop
                    self._send([(c.stream, error_output(rid, str(e)))])
            elif isinstance(c, _Abort):
                self.engine.abort_request(c.request_id)
        return added

    def _abort_all(self) -> None:
        for rid in list(self._streams):
            self.engine.abort_request(rid)

    def _step(self, added: int) -> bool:
        """One engine step; publishes stats and delivers outputs. Returns True if it stalled."""
        outputs = self.engine.step()
        self._step_time_total += self.engine.last_step_time
        stats = self.engine.stats()
        stats["step_time_total"] = self._step_time_total   # seconds inside Engine.step(), all steps
        with self._cv:
            self._shared.pending_seqs -= added
            self._shared.stats = stats
        self._deliver(outputs)
        return not outputs and stats["step_prefill_tokens"] + stats["step_decode_tokens"] == 0

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        items = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            items.append((stream, out))
        self._send(items)

    def _send(self, items: list[tuple[RequestStream, RequestOutput]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for stream, out in items:
            by_loop.setdefault(stream.loop, []).append((stream, out))
        finished = sum(1 for _, out in items if out.finished)
        if finished:
            with self._cv:
                self._shared.num_unfinished -= finished
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._hand_over, items)
            except RuntimeError:   # that loop is closed: nobody is listening any more
                pass

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

    def _fail_all(self, error: BaseException) -> None:
        with self._cv:
            commands = list(self._shared.commands)
            self._shared.commands.clear()
        message = _dead_message(error)
        streams = list(self._streams.values()) + [c.stream for c in commands if isinstance(c, _Add)]
        self._streams.clear()
        self._send([(s, error_output(s.request_id, message)) for s in streams])




def _dead_message(error: BaseException | None) -> str:
    if error is None:
        return "the engine is shutting down"
    return str(error) if isinstance(error, EngineDeadError) else f"the engine loop failed: {error!r}"
