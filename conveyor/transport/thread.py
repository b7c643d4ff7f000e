"""The engine's loop on a background thread of the caller's process (``conveyor serve
--no-engine-process``, and tests): the same ``StreamingClient`` front end as the child-process
transport, the loop's results delivered in the loop's thread.
"""

from __future__ import annotations

import asyncio
import threading

from conveyor.config import EngineConfig
from conveyor.core.loop import EngineLoop
from conveyor.core.wire import Command
from conveyor.engine.engine import Engine
from conveyor.frontend.client import StreamingClient


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
