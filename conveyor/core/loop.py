"""The engine's step loop: commands applied between steps, each step's results handed to a sink.

``EngineLoop`` is the only code that touches its ``LoopBackend`` (engine/engine.py's ``EngineBackend``:
the model and the engine core).
Callers post commands (wire.py: add a request, finish sequences, shut down) to a thread-safe queue,
applied between steps; each step's per-sequence deltas and stats go to a ``LoopSink``: a client in
the same process (transport/thread.py) or the pipe to one (transport/process.py). No torch here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Protocol

from conveyor.core.engine_core import EngineCore, EngineDeadError, SeqUpdate
from conveyor.core.stats import EngineStats
from conveyor.core.wire import Command, EngineRequest, Finish, Shutdown

logger = logging.getLogger(__name__)

# How long the loop waits before retrying when requests exist but nothing could be scheduled.
_STALL_WAIT_S = 0.01


class LoopBackend(Protocol):
    """What the loop drives: an engine core with its executor (engine/engine.py's EngineBackend)."""

    core: EngineCore
    last_step_time: float   # seconds of the latest run_step()

    @property
    def dead(self) -> bool: ...

    def add(self, request: EngineRequest) -> None: ...

    def finish(self, command: Finish) -> list[SeqUpdate]: ...

    def run_step(self) -> list[SeqUpdate]: ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def save_trace(self) -> None: ...

    def close(self) -> None: ...


class LoopSink(Protocol):
    """Where an EngineLoop's results go (a client in this process, or a pipe to one)."""

    def deliver(self, updates: list[SeqUpdate], stats: EngineStats, applied_seqs: int) -> None: ...

    def failed(self, error: BaseException) -> None: ...


class EngineLoop:
    """The engine's step loop: commands applied between steps, results handed to a sink."""

    def __init__(self, engine: LoopBackend, sink: LoopSink):
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
