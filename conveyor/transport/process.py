"""The engine's step loop in its own process, behind the same EngineClient protocol.

The server's process is the front end: HTTP, tokenization, validation (once), detokenization,
stop strings and the streams. A child process (spawned, not forked: torch's thread pools do not
survive a fork) loads the model and runs ``EngineLoop`` over an ``EngineBackend``. Validated
requests (``EngineRequest``) and finishes go down one pipe; each step's per-sequence deltas
(new token ids, their logprobs, finishes) and stats come back up another as one message
(``StepResults``) -- what a step adds, never a request's text or history again. Every message is
a declared type of wire.py, one msgpack frame each way. The two processes share
no GIL, so the front end's work on step N's deltas runs while the child computes step N+1.
The child ignores SIGINT/SIGTERM — the parent decides when it stops (a Shutdown command, or the
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
from conveyor.core.loop import EngineLoop
from conveyor.frontend.client import StreamingClient
from conveyor.core.engine_core import EngineDeadError, SeqUpdate
from conveyor.engine.engine import EngineBackend
from conveyor.frontend.front_end import FrontEnd
from conveyor.frontend.inputs import InputProcessor, grammar_backend
from conveyor.core.stats import EngineStats
from conveyor.core.wire import (WIRE_VERSION, Closed, Command, EngineRequest, LoopFailed, Ready, Result, Shutdown,
                                  StartFailed, StepResults, WireError, check_version, decode_command, decode_result,
                                  encode)
from conveyor.model.loader import load_tokenizer

logger = logging.getLogger(__name__)


class _PipeSink:
    """The child's LoopSink: each step's results as one message to the parent."""

    def __init__(self, conn):
        self.conn = conn

    def deliver(self, updates: list[SeqUpdate], stats: EngineStats, applied_seqs: int) -> None:
        _send(self.conn, StepResults(updates=updates, stats=stats, applied_seqs=applied_seqs))

    def failed(self, error: BaseException) -> None:
        _send(self.conn, LoopFailed(message=str(error), engine_dead=isinstance(error, EngineDeadError)))


def _send(conn, message: Command | Result) -> None:
    conn.send_bytes(encode(message))


def freeze_gc() -> None:
    """Exempt everything alive now (imported modules, the model, the tokenizer) from the cyclic
    garbage collector, in a long-lived serving process after start-up. A full collection walks
    every tracked object: ~310,000 of them after importing torch and building the engine, ~75 ms
    on these machines, at a moment set by allocation counts -- inside whichever step or request
    it happens to hit (measured: one such pause in a burst of arrivals raised TTFT p99 at 2 req/s
    from ~140 to ~230 ms). After the freeze a full collection takes microseconds."""
    gc.collect()
    gc.freeze()


def _child_main(config: EngineConfig, commands, results, log_level: int, wire_version: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    try:
        check_version(wire_version, "the front end")
        engine = EngineBackend(config)
    except BaseException as e:   # noqa: BLE001 - the parent reports it
        _send(results, StartFailed(message=f"{type(e).__name__}: {e}"))
        return
    loop = EngineLoop(engine, _PipeSink(results))
    freeze_gc()
    _send(results, Ready(wire_version=WIRE_VERSION, model_name=engine.model_name,
                         max_model_len=engine.max_model_len, vocab_size=engine.model_config.vocab_size,
                         dtype=engine.dtype, eos_token_ids=list(engine.model_config.eos_token_ids),
                         generation_defaults=engine.generation_defaults, stats=engine.stats()))

    def forward() -> None:
        while True:
            try:
                command = decode_command(commands.recv_bytes())
            except (EOFError, OSError):   # the parent is gone: stop now
                loop.post(Shutdown(deadline=time.monotonic()))
                return
            except WireError:   # not from our front end: nothing it sends can be trusted any more
                logger.exception("stopping: a command that is not one")
                loop.post(Shutdown(deadline=time.monotonic()))
                return
            if isinstance(command, EngineRequest) and command.params.structured_outputs is not None:
                try:   # compile here, off the step loop (the loop finds it cached)
                    engine.grammars.compile(command.params.structured_outputs)
                except ValueError:
                    pass   # the loop's add reports it
            loop.post(command)

    threading.Thread(target=forward, name="conveyor-commands", daemon=True).start()
    loop.run()
    _send(results, Closed())


class ProcessEngine(StreamingClient):
    """Runs the engine's loop in a child process; see the module docstring."""

    def __init__(self, config: EngineConfig, max_waiting: int | None = None):
        ctx = mp.get_context("spawn")
        cmd_recv, self._commands = ctx.Pipe(duplex=False)
        self._results, results_send = ctx.Pipe(duplex=False)
        # Before the child starts: a GGUF is converted once, here.
        tokenizer = load_tokenizer(config.tokenizer or config.model)
        self._proc = ctx.Process(target=_child_main, name="conveyor-engine", daemon=False,
                                 args=(config, cmd_recv, results_send, logging.getLogger().getEffectiveLevel(),
                                       WIRE_VERSION))
        self._proc.start()
        # The child is not a daemon (it may spawn tensor-parallel ranks), so at exit
        # multiprocessing joins it: close the command pipe first, which stops it.
        atexit.register(self._release_at_exit)
        cmd_recv.close()
        results_send.close()
        try:
            first = decode_result(self._results.recv_bytes())
            if isinstance(first, Ready):
                check_version(first.wire_version, "the engine process")
        except EOFError:
            first = StartFailed(message=f"the engine process exited with code {self._proc.exitcode}")
        except WireError as e:
            self._commands.close()
            first = StartFailed(message=str(e))
        if not isinstance(first, Ready):
            self._proc.join(timeout=5)
            raise RuntimeError(f"the engine process could not start: {getattr(first, 'message', first)}")
        self.model_name, self.max_model_len = first.model_name, first.max_model_len
        self.vocab_size, self.dtype = first.vocab_size, first.dtype
        self.generation_defaults = first.generation_defaults
        grammars = grammar_backend(tokenizer, self.vocab_size)   # a bad grammar is a 400 here
        inputs = InputProcessor(tokenizer, self.vocab_size, self.max_model_len, first.eos_token_ids, grammars,
                                self.generation_defaults)
        super().__init__(max_waiting, first.stats, FrontEnd(inputs, config.seed))
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

    def _post(self, command: Command) -> None:
        frame = encode(command)   # InvalidRequestError: a request that cannot cross (the caller refuses it)
        try:
            with self._send_lock:
                self._commands.send_bytes(frame)
        except (OSError, ValueError):   # the child is gone; the receiver reports why
            pass

    def _receive(self) -> None:
        while True:
            try:
                msg = decode_result(self._results.recv_bytes())
            except (EOFError, OSError):
                self._proc.join(timeout=5)
                if self._error is None and self._accepting:
                    self.failed(RuntimeError(f"the engine process exited unexpectedly "
                                             f"(exit code {self._proc.exitcode})"))
                return
            except WireError as e:   # the child speaks another language: nothing it says can be trusted
                logger.exception("the engine process sent a message that is not one")
                self.failed(e)
                self._post(Shutdown(deadline=time.monotonic()))
                return
            if isinstance(msg, StepResults):
                try:
                    self.deliver(msg.updates, msg.stats, msg.applied_seqs)
                except BaseException as e:   # noqa: BLE001 - a front-end bug must end the streams, not hang them
                    logger.exception("processing the engine's outputs failed")
                    self.failed(e)
                    self._post(Shutdown(deadline=time.monotonic()))
                    return
            elif isinstance(msg, LoopFailed):
                self.failed(EngineDeadError(msg.message) if msg.engine_dead else RuntimeError(msg.message))
            elif isinstance(msg, Closed):
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
