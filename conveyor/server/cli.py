"""`conveyor serve`: load the model, start the engine thread, serve the API with uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal

from conveyor.config import add_engine_args, config_from_args

# Extra seconds uvicorn waits for connections after the engine's own shutdown timeout.
_BACKSTOP_S = 5


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                              description="Serve a model over an OpenAI-compatible HTTP API "
                                          "(/v1/completions, /v1/chat/completions, /metrics, ...).")
    p.add_argument("model", nargs="?", default=None, help="HF model directory or .gguf file (default: the demo model)")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server to the network)")
    s.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    s.add_argument("--api-key", default=os.environ.get("CONVEYOR_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on API routes (default: $CONVEYOR_API_KEY, else open)")
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients must send; the first is reported (default: the model's name)")
    s.add_argument("--max-waiting", type=int, default=256,
                   help="queued sequences beyond which new requests get 503 + Retry-After (0 = unbounded)")
    s.add_argument("--log-interval", type=float, default=10.0,
                   help="seconds between stats log lines while busy (0 = off)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests get to finish before they are aborted")
    s.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger request bodies get 413")
    s.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=False,
                   help="log one line per HTTP request")
    s.add_argument("--log-requests", action="store_true",
                   help="log one JSON line per API request on the 'conveyor.requests' logger: id, endpoint, token "
                        "counts, finish reasons, status, queue time, TTFT, e2e, preemptions (no prompt or output text)")
    s.add_argument("--log-request-text", action="store_true",
                   help="with --log-requests: include the prompt and the output text in each line")
    s.add_argument("--request-log-file", default=None, metavar="PATH",
                   help="write the request log's JSON lines to PATH instead of stderr (implies --log-requests)")
    s.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export one OpenTelemetry span per request over OTLP/HTTP to URL (e.g. "
                        "http://localhost:4318/v1/traces); needs the 'otel' extra")
    s.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="log level of the server and engine")
    s.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine's step loop in its own process, sharing no GIL with the HTTP server "
                        "(measured: TPOT p50 44.6 -> 24.9 ms at 2 req/s on 2 cores); --no-engine-process runs it "
                        "on a thread of the server's process")
    s.add_argument("--allowed-origins", nargs="+", default=None,
                   help="CORS: origins browsers may call the API from ('*' for any); default: no CORS headers")
    s.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file path, or the template text) instead of the model's")
    s.add_argument("--tool-call-parser", default="hermes", choices=("hermes", "json"),
                   help="how tool calls are read from the output: hermes (<tool_call>{...}</tool_call> blocks) or "
                        "json (the whole output is a call object or a list of them)")
    s.add_argument("--reasoning-parser", default=None, choices=("qwen3", "deepseek_r1"),
                   help="split <think>...</think> reasoning out of the answer (chat: message.reasoning_content; "
                        "Responses: a reasoning item); default: the whole output is content")
    s.add_argument("--responses-max-stored", type=int, default=1024,
                   help="/v1/responses: stored responses kept (for previous_response_id, GET, background); the "
                        "least recently used is evicted beyond this")
    s.add_argument("--responses-max-stored-bytes", type=int, default=64 << 20,
                   help="/v1/responses: the stored responses' total size bound (bytes of their JSON)")
    s.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas (processes, each with its own KV cache and a share of the cores) behind "
                        "this one server")
    s.add_argument("--router", default="prefix", choices=("prefix", "least-load", "round-robin"),
                   help="how requests are spread over the replicas: prefix sends a prompt to the replica whose "
                        "cache holds its first KV blocks (as the replicas' KV events say) or that was last sent "
                        "them (prefix-cache hits), unless that one is much busier")
    s.add_argument("--ray", action="store_true",
                   help="serve on Ray Serve (needs the 'ray' extra): --data-parallel-size engine replicas placed, "
                        "health-checked and restarted by Ray, behind Conveyor's API on Serve's proxy; starts a local "
                        "Ray, or joins $RAY_ADDRESS (docs/scale-out.md)")
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


def _observability(args: argparse.Namespace):
    """Set up the request log's destination; the TracerProvider for --otlp-traces-endpoint (or None)."""
    from conveyor.server import observe

    if args.request_log_file:
        observe.log_to_file(args.request_log_file)
    elif args.log_requests:
        observe.logger.setLevel(logging.INFO)   # shown even under --log-level warning
    if not args.otlp_traces_endpoint:
        return None
    from conveyor.server.tracing import make_tracer_provider

    try:
        return make_tracer_provider(args.otlp_traces_endpoint)
    except RuntimeError as e:
        raise SystemExit(str(e)) from e


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from conveyor.engine.async_engine import AsyncEngine
    from conveyor.server.app import build_app

    class Server(uvicorn.Server):
        """Drains the engine alongside uvicorn's own shutdown, so that in-flight streams finish,
        or end with an error event and [DONE], before uvicorn's backstop cuts connections."""

        async def shutdown(self, sockets=None) -> None:
            drain = asyncio.create_task(engine.shutdown(args.shutdown_timeout))
            await super().shutdown(sockets)
            await drain

        def handle_exit(self, sig: int, frame) -> None:
            if self.should_exit:   # a second SIGTERM / Ctrl-C while draining: do not wait any longer
                logging.getLogger("conveyor.server").warning(
                    "%s during the graceful shutdown: exiting now", signal.Signals(sig).name)
                logging.shutdown()
                os._exit(128 + sig)
            super().handle_exit(sig, frame)

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tracer_provider = _observability(args)
    config = config_from_args(args, model=args.model)
    from conveyor.parallel.tp import launched_by_torchrun, run_worker_from_env

    if launched_by_torchrun() and os.environ["RANK"] != "0":
        return run_worker_from_env(config.device)   # a tensor-parallel rank > 0: rank 0 serves
    if args.data_parallel_size > 1:
        if not args.engine_process:
            raise SystemExit("--data-parallel-size > 1 runs each replica in its own process; "
                             "drop --no-engine-process")
        from conveyor.engine.data_parallel import DataParallelEngine

        engine = DataParallelEngine(config, args.data_parallel_size, args.router,
                                    max_waiting=args.max_waiting or None)
    elif args.engine_process:
        from conveyor.engine.process_engine import ProcessEngine

        engine = ProcessEngine(config, max_waiting=args.max_waiting or None)
    else:
        engine = AsyncEngine.from_config(config, max_waiting=args.max_waiting or None)
    if args.chat_template:
        engine.tokenizer.chat_template = read_chat_template(args.chat_template)
    app = build_app(engine, served_model_names=args.served_model_name, api_key=args.api_key,
                    max_body_bytes=args.max_body_bytes, log_interval=args.log_interval,
                    shutdown_timeout=args.shutdown_timeout, tool_call_parser=args.tool_call_parser,
                    allowed_origins=args.allowed_origins, reasoning_parser=args.reasoning_parser,
                    log_requests=args.log_requests or args.request_log_file is not None,
                    log_request_text=args.log_request_text, tracer_provider=tracer_provider,
                    responses_max_stored=args.responses_max_stored,
                    responses_max_stored_bytes=args.responses_max_stored_bytes)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.access_log,
                            timeout_graceful_shutdown=math.ceil(args.shutdown_timeout) + _BACKSTOP_S)
    server = Server(config)
    from conveyor.engine.process_engine import freeze_gc

    freeze_gc()   # this process lives as long as the server: no full-heap collection pauses
    # uvicorn re-raises the signal that stopped it once it is done; after a graceful shutdown
    # that should be a clean exit (status 0), not death by SIGTERM.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    asyncio.run(server.serve())
    engine.close()   # no-op if the lifespan already shut it down
    if tracer_provider is not None:
        tracer_provider.shutdown()   # exports the spans still batched
    return 0 if server.started else 1
