"""The engine's step loop in its own process, behind the same EngineClient protocol.

The server's process is the front end: HTTP, tokenization, validation (once), detokenization,
stop strings and the streams. A child process (spawned, not forked: torch's thread pools do not
survive a fork) loads the model and runs ``EngineLoop`` over an ``EngineBackend``. Validated
requests (``EngineRequest``) and finishes go down one pipe; each step's per-sequence deltas
(new token ids, their logprobs, finishes) and stats come back up another as one pickled
message -- what a step adds, never a request's text or history again. The two processes share
no GIL, so the front end's work on step N's deltas runs while the child computes step N+1.
The child ignores SIGINT/SIGTERM — the parent decides when it stops (a Stop command, or the
command pipe closing when the parent dies).
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import logging
import multiprocessing as mp
import signal
import threading
import time

from conveyor.config import EngineConfig
from conveyor.engine.async_engine import Add, EngineLoop, Stop, StreamingClient
from conveyor.engine.core import EngineDeadError, SeqUpdate
from conveyor.engine.frontend import Finish, FrontEnd
from conveyor.engine.inputs import InputProcessor, grammar_backend
from conveyor.engine.stats import EngineStats
from conveyor.model.loader import load_tokenizer
from conveyor.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


class _PipeSink:
    """The child's LoopSink: each step's results as one message to the parent."""

    def __init__(self, conn):
        self.conn = conn

    def deliver(self, updates: list[SeqUpdate], stats: EngineStats, applied_seqs: int) -> None:
        self.conn.send(("out", updates, stats, applied_seqs))

    def failed(self, error: BaseException) -> None:
        self.conn.send(("failed", str(error), isinstance(error, EngineDeadError)))


def freeze_gc() -> None:
    """Exempt everything alive now (imported modules, the model, the tokenizer) from the cyclic
    garbage collector, in a long-lived serving process after start-up. A full collection walks
    every tracked object: ~310,000 of them after importing torch and building the engine, ~75 ms
    on these machines, at a moment set by allocation counts -- inside whichever step or request
    it happens to hit (measured: one such pause in a burst of arrivals raised TTFT p99 at 2 req/s
    from ~140 to ~230 ms). After the freeze a full collection takes microseconds."""
    gc.collect()
    gc.freeze()


def _child_main(config: EngineConfig, commands, results, log_level: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    try:
        from conveyor.engine.engine import EngineBackend

        engine = EngineBackend(config)
    except BaseException as e:   # noqa: BLE001 - the parent reports it
        results.send(("error", f"{type(e).__name__}: {e}"))
        return
    loop = EngineLoop(engine, _PipeSink(results))
    freeze_gc()
    results.send(("ready", {"model_name": engine.model_name, "max_model_len": engine.max_model_len,
                            "vocab_size": engine.model_config.vocab_size, "stats": engine.stats(),
                            "dtype": engine.dtype, "eos_token_ids": list(engine.model_config.eos_token_ids),
                            "generation_defaults": engine.generation_defaults}))

    def forward() -> None:
        while True:
            try:
                command = commands.recv()
            except (EOFError, OSError):   # the parent is gone: stop now
                loop.post(Stop(time.monotonic()))
                return
            request = getattr(command, "request", None)
            constraint = request.params.structured_outputs if request is not None else None
            if constraint is not None:   # compile here, off the step loop (the loop finds it cached)
                try:
                    engine.grammars.compile(constraint)
                except ValueError:
                    pass   # the loop's add_request reports it
            loop.post(command)

    threading.Thread(target=forward, name="conveyor-commands", daemon=True).start()
    loop.run()
    results.send(("closed",))


class ProcessEngine(StreamingClient):
    """Runs the engine's loop in a child process; see the module docstring."""

    def __init__(self, config: EngineConfig, max_waiting: int | None = None):
        ctx = mp.get_context("spawn")
        cmd_recv, self._commands = ctx.Pipe(duplex=False)
        self._results, results_send = ctx.Pipe(duplex=False)
        # Before the child starts: a GGUF is converted once, here.
        tokenizer = load_tokenizer(config.tokenizer or config.model)
        self._proc = ctx.Process(target=_child_main, name="conveyor-engine", daemon=False,
                                 args=(config, cmd_recv, results_send, logging.getLogger().getEffectiveLevel()))
        self._proc.start()
        # The child is not a daemon (it may spawn tensor-parallel ranks), so at exit
        # multiprocessing joins it: close the command pipe first, which stops it.
        atexit.register(self._release_at_exit)
        cmd_recv.close()
        results_send.close()
        try:
            first = self._results.recv()
        except EOFError:
            first = ("error", f"the engine process exited with code {self._proc.exitcode}")
        if first[0] != "ready":
            self._proc.join(timeout=5)
            raise RuntimeError(f"the engine process could not start: {first[1]}")
        info = first[1]
        self.model_name, self.max_model_len = info["model_name"], info["max_model_len"]
        self.vocab_size, self.dtype = info["vocab_size"], info["dtype"]
        self.generation_defaults = info["generation_defaults"]
        grammars = grammar_backend(tokenizer, self.vocab_size)   # a bad grammar is a 400 here
        inputs = InputProcessor(tokenizer, self.vocab_size, self.max_model_len, info["eos_token_ids"], grammars,
                                SamplingParams(**self.generation_defaults))
        super().__init__(max_waiting, info["stats"], FrontEnd(inputs, config.seed))
        self._send_lock = threading.Lock()
        self._receiver = threading.Thread(target=self._receive, name="conveyor-results", daemon=True)
        self._receiver.start()

    def _release_at_exit(self) -> None:
        try:
            self._commands.close()
        except OSError:
            pass
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()

    def _post(self, command: Add | Finish | Stop) -> None:
        try:
            with self._send_lock:
                self._commands.send(command)
        except (OSError, ValueError):   # the child is gone; the receiver reports why
            pass

    def _receive(self) -> None:
        while True:
            try:
                msg = self._results.recv()
            except (EOFError, OSError):
                self._proc.join(timeout=5)
                if self._error is None and self._accepting:
                    self.failed(RuntimeError(f"the engine process exited unexpectedly "
                                             f"(exit code {self._proc.exitcode})"))
                return
            if msg[0] == "out":
                try:
                    self.deliver(msg[1], msg[2], msg[3])
                except BaseException as e:   # noqa: BLE001 - a front-end bug must end the streams, not hang them
                    logger.exception("processing the engine's outputs failed")
                    self.failed(e)
                    self._post(Stop(time.monotonic()))
                    return
            elif msg[0] == "failed":
                self.failed(EngineDeadError(msg[1]) if msg[2] else RuntimeError(msg[1]))
            elif msg[0] == "closed":
                return

    @property
    def is_healthy(self) -> bool:
        return self._accepting and self._error is None and self._proc.is_alive()

    async def shutdown(self, timeout: float = 30.0) -> None:
        self._stop(timeout)
        await asyncio.to_thread(self._join)

    def close(self, timeout: float = 0.0) -> None:
        self._stop(timeout)
        self._join()

    def _join(self) -> None:
        self._receiver.join()
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
