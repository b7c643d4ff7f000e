"""One graceful shutdown for every entry point: `conveyor serve` (one engine or data-parallel
replicas), `conveyor serve --ray` and `conveyor run-batch`.

The first SIGTERM or SIGINT starts a drain: the engine takes no new requests (they get a 503), the
ones in flight get up to the shutdown timeout to finish, then what is left is aborted (a stream
ends with an error event and ``data: [DONE]``, a non-streaming request gets a 503). A second
signal cuts the drain to zero; a third exits at once (for an engine that no longer answers).
The process then exits 0 if the drain finished everything in flight, else ``EXIT_CUT_SHORT``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from conveyor.frontend.client import EngineClient

logger = logging.getLogger("conveyor.server")

EXIT_CUT_SHORT = 75   # sysexits.h's EX_TEMPFAIL: some requests were aborted by the shutdown; retry them

SIGNALS = (signal.SIGINT, signal.SIGTERM)

# The engine's own deadline comes this much after the drain's, so that the drain is the one that
# aborts (and knows what it cut); the engine's is the fallback for an event loop that is stuck.
_ENGINE_SLACK_S = 2.0


class Signals:
    """SIGINT and SIGTERM counted for the rest of the process's life, each handed to `on_signal(sig,
    count)`. Never given back to the default action: a signal between two phases of the shutdown
    (after an event loop closed, say) must not kill the process mid-way."""

    def __init__(self) -> None:
        self.count = 0
        self._received: list[int] = []
        self._on_signal: Callable[[int, int], None] | None = None

    @classmethod
    def install(cls) -> Signals:
        """Take SIGINT and SIGTERM over (after anything that installs its own handlers, like ray.init)."""
        signals = cls()
        for sig in SIGNALS:
            signal.signal(sig, signals._handle)
        return signals

    def attach(self, on_signal: Callable[[int, int], None]) -> None:
        """Send signals to `on_signal` from now on, those already received first."""
        self._on_signal = on_signal
        for count, sig in enumerate(self._received, 1):
            on_signal(sig, count)

    def attach_drain(self, drain: Drain, loop: asyncio.AbstractEventLoop) -> None:
        """Signals drive `drain` on `loop` (the handler runs between two bytecodes of the loop's own thread)."""
        def hand_over(sig: int, count: int) -> None:
            try:
                loop.call_soon_threadsafe(drain.on_signal, sig, count)
            except RuntimeError:   # the loop is closed: its drain is over
                pass

        self.attach(hand_over)

    def _handle(self, sig: int, frame) -> None:
        self.count += 1
        if self.count >= 3:
            logger.error("%s a third time: exiting now", signal.Signals(sig).name)
            logging.shutdown()
            os._exit(128 + sig)
        self._received.append(sig)
        if self._on_signal is not None:
            self._on_signal(sig, self.count)


class Drain:
    """The shutdown of one engine client: `start` (the first signal) stops taking requests and lets
    those in flight finish for up to `timeout` s; `cut` (the second) aborts them now. Event-loop side."""

    def __init__(self, client: EngineClient, timeout: float):
        self.client = client
        self.timeout = timeout
        self.cut_short = False   # requests were still in flight when the drain ended: they were aborted
        self._cut = asyncio.Event()
        self._ended = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def started(self) -> bool:
        return self._task is not None

    def start(self) -> asyncio.Task:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
        return self._task

    def cut(self) -> asyncio.Task:
        self._cut.set()
        return self.start()

    async def wait(self) -> bool:
        """Drain (if nobody started it yet) and wait for the end; True if it was cut short."""
        await asyncio.shield(self.start())
        return self.cut_short

    async def finished(self) -> None:
        """Wait for the end of a drain that someone else starts."""
        await self._ended.wait()

    def on_signal(self, sig: int, count: int) -> None:
        name = signal.Signals(sig).name
        if count == 1:
            logger.warning("%s: draining; requests in flight get up to %g s to finish (a second signal "
                           "aborts them now)", name, self.timeout)
            self.start()
        else:
            logger.warning("%s during the drain: aborting the requests in flight", name)
            self.cut()

    async def _run(self) -> None:
        try:
            await self._drain()
        finally:
            self._ended.set()

    async def _drain(self) -> None:
        stop = asyncio.ensure_future(self.client.shutdown(self.timeout + _ENGINE_SLACK_S))
        cut = asyncio.ensure_future(self._cut.wait())
        await asyncio.wait({stop, cut}, timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED)
        cut.cancel()
        if not stop.done():
            self.cut_short = self.client.stats().num_unfinished_requests > 0
            await self.client.shutdown(0)   # the engine takes the earlier deadline: now
        await stop
        if self.cut_short:
            logger.warning("drain cut short: the requests still in flight were aborted")
        else:
            logger.info("drained: every request in flight finished")
