"""`conveyor serve`: load the model, start the engine thread, serve the API with uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
from collections.abc import Iterator

from conveyor.config import add_engine_args, config_from_args
from conveyor.server.config import ServerConfig, add_server_args, server_config_from_args
from conveyor.server.shutdown import EXIT_CUT_SHORT, Drain, Signals

# Seconds uvicorn waits, after the drain, for the connections to send their last bytes.
_BACKSTOP_S = 5


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                              description="Serve a model over an OpenAI-compatible HTTP API "
                                          "(/v1/completions, /v1/chat/completions, /metrics, ...).")
    p.add_argument("model", nargs="?", default=None, help="HF model directory or .gguf file (default: the demo model)")
    add_server_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)
    return p


def read_chat_template(spec: str) -> str:
    """--chat-template: a file's contents, or the argument itself when it is not a file."""
    path = os.path.expanduser(spec)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    if "{" not in spec:
        raise SystemExit(f"--chat-template {spec!r}: no such file, and it does not look like a Jinja template")
    return spec


def _observability(server: ServerConfig):
    """Set up the request log's destination; the TracerProvider for --otlp-traces-endpoint (or None)."""
    # lazy: keeps starlette out of the CLI's start-up
    from conveyor.server import observe
    from conveyor.server.tracing import make_tracer_provider

    if server.request_log_file:
        observe.log_to_file(server.request_log_file)
    elif server.log_requests:
        observe.logger.setLevel(logging.INFO)   # shown even under --log-level warning
    if not server.otlp_traces_endpoint:
        return None
    try:
        return make_tracer_provider(server.otlp_traces_endpoint)
    except RuntimeError as e:
        raise SystemExit(str(e)) from e


def cmd_serve(args: argparse.Namespace) -> int:
    # lazy: keeps torch and uvicorn out of the CLI's start-up
    import uvicorn

    from conveyor.transport.thread import AsyncEngine
    from conveyor.transport.process import freeze_gc
    from conveyor.parallel.tp import launched_by_torchrun, run_worker_from_env
    from conveyor.server.app import build_app

    class Server(uvicorn.Server):
        """uvicorn without its own signal handling: the drain (server/shutdown.py) decides when it stops."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    server = server_config_from_args(args)
    logging.basicConfig(level=server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tracer_provider = _observability(server)
    config = config_from_args(args, model=args.model)
    if (server.lora_modules or server.allow_runtime_lora_updating) and not config.enable_lora:
        raise SystemExit("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
    if launched_by_torchrun() and os.environ["RANK"] != "0":
        return run_worker_from_env(config.device)   # a tensor-parallel rank > 0: rank 0 serves
    max_waiting = server.max_waiting or None
    if server.data_parallel_size > 1:
        if not server.engine_process:
            raise SystemExit("--data-parallel-size > 1 runs each replica in its own process; "
                             "drop --no-engine-process")
        # lazy: keeps torch out of the CLI's start-up
        from conveyor.transport.data_parallel import DataParallelEngine

        engine = DataParallelEngine(config, server.data_parallel_size, server.router, max_waiting=max_waiting)
    elif server.engine_process:
        # lazy: keeps torch out of the CLI's start-up
        from conveyor.transport.process import ProcessEngine

        engine = ProcessEngine(config, max_waiting=max_waiting)
    else:
        engine = AsyncEngine.from_config(config, max_waiting=max_waiting)
    if server.chat_template:
        engine.tokenizer.chat_template = read_chat_template(server.chat_template)
    app = build_app(engine, server, tracer_provider=tracer_provider)
    uv = Server(uvicorn.Config(app, host=server.host, port=server.port, log_level=server.log_level,
                               access_log=server.access_log, timeout_graceful_shutdown=_BACKSTOP_S))
    freeze_gc()   # this process lives as long as the server: no full-heap collection pauses
    signals = Signals.install()
    asyncio.run(serve_until_drained(uv, app.state.drain, signals))
    engine.close()   # no-op if the lifespan already shut it down
    if tracer_provider is not None:
        tracer_provider.shutdown()   # exports the spans still batched
    if not uv.started:
        return 1
    return EXIT_CUT_SHORT if app.state.drain.cut_short else 0


async def serve_until_drained(uv, drain: Drain, signals: Signals) -> None:
    """Serve until a signal's drain is over (the listener stays open meanwhile: new requests get a 503),
    then let uvicorn send the connections' last bytes, close them and run the app's shutdown."""
    async def stop_when_drained() -> None:
        await drain.finished()
        uv.should_exit = True

    signals.attach_drain(drain, asyncio.get_running_loop())
    watcher = asyncio.ensure_future(stop_when_drained())
    try:
        await uv.serve()
    finally:
        watcher.cancel()
