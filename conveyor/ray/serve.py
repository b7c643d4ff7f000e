"""Conveyor on Ray Serve: Ray owns the replicas (placement, health checks, restarts, autoscaling).

Two deployments in one Serve application, the same split as Ray Serve LLM's ingress + LLM server:

- ``ConveyorEngine`` (N replicas): each holds one engine (an in-process ``AsyncEngine``, or a
  ``ProcessEngine``) and streams its ``RequestOutput``s for a prompt. Its resources come from
  ``get_deployment_options`` (a placement bundle of CPUs, plus a GPU on CUDA); Serve's health
  check fails once the engine is dead, so Serve replaces the replica.
- ``ConveyorIngress``: Conveyor's whole FastAPI app (``build_app``: completions, chat, streaming,
  Responses, Messages, tokenize, /metrics...) behind Serve's HTTP proxy, over a ``RayEngineClient``
  (an ``EngineClient``) that sends each tokenized prompt to an engine replica through a Serve
  deployment handle.

The handle routes with ``PrefixRouter``, a Serve ``RequestRouter`` that applies Conveyor's prefix
policy (``conveyor.routing.Router``, the one the built-in ``--data-parallel-size`` server and
the simulator use) to the prompt's token ids, with each replica's in-flight requests as its load. Routing
at the handle, not at the HTTP proxy, is what makes the prefix visible: the proxy forwards the
ASGI scope and streams the body to the replica later, so a router there never sees the prompt.

Ray Serve LLM (``ray.serve.llm``, ``LLMConfig(server_cls=...)``) is not used: in Ray 2.60 importing
its protocol models raises "Neither vLLM nor SGLang is installed", so it cannot run a third-party
engine without one of them installed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Callable

from conveyor.config import EngineConfig, config_from_args
from conveyor.frontend.client import Overloaded, RequestStream
from conveyor.transport.thread import AsyncEngine
from conveyor.core.engine_core import EngineDeadError
from conveyor.transport.data_parallel import replica_config
from conveyor.frontend.inputs import InputProcessor, ProcessedRequest, grammar_backend
from conveyor.frontend.output_processor import error_output
from conveyor.frontend.outputs import CompletionOutput, RequestOutput
from conveyor.transport.process import ProcessEngine
from conveyor.core.stats import EngineStats
from conveyor.kv.events import offset_endpoint
from conveyor.model.loader import load_tokenizer
from conveyor.routing import Router
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler.deadlines import QUEUE_TIMEOUT
from conveyor.server.app import build_app
from conveyor.server.cli import read_chat_template
from conveyor.server.config import server_config_from_args

logger = logging.getLogger(__name__)

APP_NAME = "conveyor"
ENGINE_DEPLOYMENT = "ConveyorEngine"
INGRESS_DEPLOYMENT = "ConveyorIngress"


@dataclass(slots=True)
class ReplicaOutput:
    """What an engine replica streams back for a request: each output, with the replica's stats then."""

    replica: str          # the replica's tag
    stats: EngineStats
    output: RequestOutput


# ---- placement ---------------------------------------------------------------------------------

def get_deployment_options(config: EngineConfig, *, num_replicas: int | str | None = 1,
                           autoscaling_config: dict | None = None, num_cpus: float | None = None,
                           max_ongoing_requests: int | None = None) -> dict[str, Any]:
    """Serve deployment options for the engine replicas of `config`: one placement bundle per
    replica, ``{"CPU": k}`` on CPU and ``{"GPU": 1, "CPU": k}`` on CUDA (k: `num_cpus`, else the
    config's torch threads, else 1); with tensor parallelism, one such bundle per rank: with
    ``distributed_executor_backend="ray"`` the replica (rank 0) runs in bundle 0 and places ranks
    1..N-1 in the others as Ray actors, PACK (on other nodes when one has no room); with "mp" they are
    the replica's own processes, STRICT_PACK on its node. `autoscaling_config` replaces `num_replicas`."""
    tp = config.tensor_parallel_size
    cpus = float(num_cpus if num_cpus is not None else (config.torch_threads or 1))
    bundle: dict[str, float] = {"CPU": cpus}
    if str(config.device).startswith("cuda"):
        bundle = {"GPU": 1.0, "CPU": cpus}
    opts: dict[str, Any] = {
        "placement_group_bundles": [dict(bundle) for _ in range(tp)],
        "placement_group_strategy": "PACK" if config.distributed_executor_backend == "ray" else "STRICT_PACK",
        # the replica actor itself runs in the first bundle
        "ray_actor_options": {"num_cpus": cpus, **({"num_gpus": 1.0} if "GPU" in bundle else {})},
        "max_ongoing_requests": max_ongoing_requests or max(64, 2 * config.scheduler.max_num_seqs),
        "health_check_period_s": 5,
        "health_check_timeout_s": 60,
    }
    if autoscaling_config is not None:
        opts["autoscaling_config"] = autoscaling_config
    else:
        opts["num_replicas"] = 1 if num_replicas is None else num_replicas
    return opts


# ---- the engine replica ------------------------------------------------------------------------

class EngineReplica:
    """One engine per replica; `generate` streams (replica tag, engine stats, RequestOutput)."""

    def __init__(self, config: EngineConfig, max_waiting: int | None = None, engine_process: bool = False,
                 chat_template: str | None = None):
        from ray import serve   # lazy: optional dependency (ray)

        context = serve.get_replica_context()
        self.tag = context.replica_id.unique_id
        rank = getattr(context, "rank", None)   # Serve's replica rank (recent Serve): 0..N-1, kept by a replacement
        self.rank = int(getattr(rank, "rank", rank) or 0)
        # The replica's rank is its data-parallel rank: KV events on endpoint port + rank, with dp_rank = rank;
        # a step trace of its own (NAME.replicaR.json).
        config = replica_config(config, self.rank)
        if engine_process and config.tensor_parallel_size > 1 and config.distributed_executor_backend == "ray":
            # Ray-placed ranks use this actor's placement group, which a child process is not in
            logger.info("tensor-parallel ranks placed by Ray: the engine runs in the replica's own process")
            engine_process = False
        if engine_process:
            self.engine = ProcessEngine(config, max_waiting=max_waiting)
        else:
            self.engine = AsyncEngine.from_config(config, max_waiting=max_waiting)
        if chat_template:
            self.engine.tokenizer.chat_template = chat_template
        self.config = config
        if self.engine_kv_events() is not None:
            logger.info("engine replica %s (rank %d): KV events on %s", self.tag, self.rank, self.engine_kv_events())

    def info(self) -> dict:
        """What a front end needs to tokenize and validate for this engine."""
        inputs = self.engine.frontend.inputs
        return {"model_name": self.engine.model_name, "max_model_len": self.engine.max_model_len,
                "vocab_size": inputs.vocab_size, "eos_token_ids": list(inputs.eos_token_ids),
                "dtype": str(getattr(self.engine, "dtype", "")), "tokenizer": self.config.tokenizer or self.config.model,
                "chat_template": self.engine.tokenizer.chat_template, "seed": self.config.seed,
                "generation_defaults": self.engine.generation_defaults}

    async def generate(self, request: ProcessedRequest, request_id: str, priority: int = 0):
        """The request's outputs as ReplicaOutputs (the front end processed it: not checked again here)."""
        try:
            stream = self.engine.add_request(request, None, request_id, priority)
        except Overloaded as e:
            yield ReplicaOutput(self.tag, self.engine.stats(), error_output(request_id, str(e), code=QUEUE_TIMEOUT))
            return
        except EngineDeadError as e:
            yield ReplicaOutput(self.tag, self.engine.stats(), error_output(request_id, str(e)))
            return
        try:
            async for out in stream:
                yield ReplicaOutput(self.tag, self.engine.stats(), out)
        finally:   # cancelled by the caller (client gone, abort): free the KV blocks now
            if not stream.finished:
                self.engine.abort(request_id)

    def reconfigure(self, user_config: Any = None, rank: Any = None) -> None:
        """Serve's reconfigure hook. After a scale-down Serve renumbers its replicas' ranks; this replica
        keeps publishing KV events as the rank it started with (its ports are bound), so it says so."""
        new = getattr(rank, "rank", rank)
        if new is not None and int(new) != self.rank and self.config.kv_events_endpoint:
            logger.warning("engine replica %s: Serve renumbered it to rank %s; its KV events keep dp_rank %d and "
                           "their ports (a new replica given rank %d on this node cannot bind them)",
                           self.tag, new, self.rank, self.rank)

    def engine_kv_events(self) -> dict | None:
        """Where this replica publishes KV events (None: off): its dp_rank, its node's address and
        the endpoints it bound (the configured ports + its rank), for a subscriber to connect to."""
        if not self.config.kv_events_endpoint:
            return None
        import ray   # lazy: optional dependency (ray)

        return {"dp_rank": self.rank, "node_ip": ray.util.get_node_ip_address(),
                "endpoint": offset_endpoint(self.config.kv_events_endpoint, self.rank),
                "replay_endpoint": offset_endpoint(self.config.kv_events_replay_endpoint, self.rank)}

    def stats(self) -> tuple[str, EngineStats]:
        return self.tag, self.engine.stats()

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve's routing stats hook (``RunningReplica.routing_stats``)."""
        s = self.engine.stats()
        return {"num_unfinished_requests": s.num_unfinished_requests, "kv_usage": s.kv_usage,
                "prefix_cache_hits": s.prefix_cache_hits, "prefix_cache_queries": s.prefix_cache_queries}

    def check_health(self) -> None:
        """Serve's health check: a dead engine makes Serve replace this replica."""
        if not self.engine.is_healthy:
            raise RuntimeError(f"the engine is not running: {self.engine.dead_reason}")

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


# ---- the front end's engine client -------------------------------------------------------------

class RayEngineClient:
    """An ``EngineClient`` whose engines are the replicas of a Serve deployment (through `handle`).

    Validation and tokenization happen here (the HTTP layer's usual path); each request is one
    streaming call to a replica, chosen by the handle's request router. A replica that dies fails
    its in-flight requests (an error output, as for a dead engine); Serve starts another.
    Per-replica stats (for /metrics, with a ``replica`` label) are as of each replica's latest output.
    """

    def __init__(self, handle: Any, info: dict):
        self._generate = handle.options(stream=True).generate
        self.model_name, self.max_model_len = info["model_name"], info["max_model_len"]
        self.dtype = info.get("dtype")
        self.generation_defaults = info["generation_defaults"]
        self.tokenizer = load_tokenizer(info["tokenizer"])
        if info.get("chat_template"):
            self.tokenizer.chat_template = info["chat_template"]
        grammars = grammar_backend(self.tokenizer, info["vocab_size"])
        self.inputs = InputProcessor(self.tokenizer, info["vocab_size"], self.max_model_len,
                                     info["eos_token_ids"], grammars, self.generation_defaults)
        self._tasks: dict[str, asyncio.Task] = {}
        self._streams: dict[str, RequestStream] = {}
        self._listeners: list[Callable[[RequestOutput], None]] = []
        self._replicas: OrderedDict[str, tuple[EngineStats, bool]] = OrderedDict()   # tag -> latest
        self.served_by: OrderedDict[str, str] = OrderedDict()   # request id -> replica tag (bounded)
        self._accepting = True

    # ---- EngineClient ----------------------------------------------------------------------
    def add_request(self, prompt: str | list[int] | dict | ProcessedRequest, params: SamplingParams | None,
                    request_id: str, priority: int = 0) -> RequestStream:
        if not self._accepting:
            raise EngineDeadError("the server is shutting down")
        if request_id in self._tasks:
            raise ValueError(f"duplicate request id {request_id!r}")
        if not isinstance(prompt, ProcessedRequest):
            prompt = self.inputs.process(prompt, params)   # InvalidRequestError here, at once
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, loop)
        self._streams[request_id] = stream
        self._tasks[request_id] = loop.create_task(self._pump(stream, prompt, request_id, priority))
        return stream

    def abort(self, request_id: str) -> None:
        task = self._tasks.pop(request_id, None)
        stream = self._streams.get(request_id)
        if task is not None:
            task.cancel()   # cancels the replica's generator, which aborts the request there
        if stream is not None and not stream.finished:
            self._put(stream, RequestOutput(request_id, None, [], [CompletionOutput(0, "", [], None, "abort")],
                                            True))

    def stats(self) -> EngineStats:
        return EngineStats.combine([s for s, _ in self._replicas.values()] or [EngineStats()])

    def replica_stats(self) -> list[EngineStats]:
        return [s for s, _ in self._replicas.values()] or [EngineStats()]

    def replica_health(self) -> list[bool]:
        return [up for _, up in self._replicas.values()] or [True]

    def replica_tags(self) -> list[str]:
        return list(self._replicas)

    def add_finished_listener(self, listener: Callable[[RequestOutput], None]) -> None:
        self._listeners.append(listener)

    @property
    def is_healthy(self) -> bool:
        return self._accepting   # the replicas' health is Serve's business (it replaces dead ones)

    @property
    def dead_reason(self) -> str | None:
        return None

    async def shutdown(self, timeout: float = 30.0) -> None:
        self._accepting = False
        tasks = list(self._tasks.values())
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            for rid in [r for r, t in self._tasks.items() if t in pending]:
                self.abort(rid)

    def close(self, timeout: float = 0.0) -> None:
        self._accepting = False

    # ---- internals ---------------------------------------------------------------------------
    async def _pump(self, stream: RequestStream, request: ProcessedRequest, request_id: str, priority: int) -> None:
        gen = None
        tag = None
        try:
            _own_serve_request_id()
            gen = self._generate.remote(request, request_id, priority)
            async for item in gen:
                tag, stats, out = item.replica, item.stats, item.output
                self._seen(tag, stats, True)
                if request_id not in self.served_by:
                    self.served_by[request_id] = tag
                    while len(self.served_by) > 10_000:
                        self.served_by.popitem(last=False)
                self._put(stream, out)
                if out.finished:
                    return
            self._put(stream, error_output(request_id, "the engine replica ended the stream without a result"))
        except asyncio.CancelledError:
            if gen is not None:
                gen.cancel()
            raise
        except Exception as e:   # noqa: BLE001 - the replica died or the call failed: this request fails
            message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if tag is not None and _actor_died(e):
                self._seen(tag, EngineStats(), False)   # a dead replica reports zeros
            logger.warning("request %s failed on engine replica %s: %s", request_id, tag, message)
            self._put(stream, error_output(request_id, f"the engine replica failed ({type(e).__name__}): {message}"))
        finally:
            self._tasks.pop(request_id, None)

    def _seen(self, tag: str, stats: EngineStats, up: bool) -> None:
        self._replicas[tag] = (stats, up)

    def _put(self, stream: RequestStream, out: RequestOutput) -> None:
        if stream.finished or self._streams.get(stream.request_id) is not stream:
            return
        stream.put(out)
        if out.finished:
            self._streams.pop(stream.request_id, None)
            for listener in self._listeners:
                try:
                    listener(out)
                except Exception:   # noqa: BLE001 - metrics must not break delivery
                    logger.exception("finished-request listener failed")


def _own_serve_request_id() -> None:
    """Give this task's handle call its own Serve request id. Inside an HTTP request every handle call
    inherits that request's internal id, and Serve's router (without its FIFO mixin, which would
    hand a replica chosen for one prompt to another) matches routed replicas to pending calls by that
    id: the prompts of one request (n prompts, or best-of siblings) would collide and wait forever.
    Private Serve API (ray.serve.context, Ray 2.60); the task's context is its own copy."""
    from ray.serve import context   # lazy: optional dependency (ray)

    current = context._get_serve_request_context()
    context._serve_request_context.set(replace(current, _internal_request_id=uuid.uuid4().hex))


def _actor_died(e: BaseException) -> bool:
    # lazy: optional dependency (ray)
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(e, (ActorDiedError, ActorUnavailableError, RayActorError))


# ---- the HTTP ingress --------------------------------------------------------------------------

class IngressReplica:
    """Conveyor's FastAPI app over a RayEngineClient (built in ``__serve_build_asgi_app__``)."""

    def __init__(self, engine_handle: Any, app_options: dict | None = None):
        self._handle = engine_handle
        self._app_options = dict(app_options or {})
        self.client: RayEngineClient | None = None

    async def __serve_build_asgi_app__(self):
        info = await self._handle.info.remote()
        self.client = RayEngineClient(self._handle, info)
        return build_app(self.client, **{"log_interval": 0, **self._app_options})


# ---- the request router ------------------------------------------------------------------------

def _prefix_router_class():
    from ray.serve.request_router import RequestRouter   # lazy: optional dependency (ray)

    class PrefixRouter(RequestRouter):
        """Conveyor's routing policy over Serve's replicas: the prompt's token ids (the first argument
        of ``generate``) and each replica's in-flight requests from this handle."""

        def initialize_state(self, policy: str = "prefix", block_size: int = 16, prefix_blocks: int = 4,
                             balance_slack: int = 8, **_: Any) -> None:
            self._policy = Router(policy, block_size, prefix_blocks, balance_slack)
            self._index: dict[str, int] = {}    # replica tag -> stable index for the policy
            self._inflight: dict[Any, int] = {}   # replica id -> requests sent and not done
            # replica id -> times it was chosen but not yet sent to: requests routed at the same
            # moment count each other (a reservation not followed by a send lapses after a second)
            self._reserved: dict[Any, list[float]] = {}

        async def choose_replicas(self, candidate_replicas, pending_request=None):
            if not candidate_replicas:
                return []
            ids: list[int] = []
            salt = None
            if pending_request is not None and pending_request.args:
                first = pending_request.args[0]   # generate(request, ...): the front end's ProcessedRequest
                if isinstance(first, ProcessedRequest):
                    ids, salt = first.prompt_token_ids, first.cache_salt
            by_index = {}
            for r in candidate_replicas:
                tag = r.replica_id.unique_id
                i = self._index.setdefault(tag, len(self._index))
                by_index[i] = r
            loads: list[float | None] = [None] * len(self._index)
            now = time.monotonic()
            for i, r in by_index.items():
                held = self._reserved.get(r.replica_id, [])
                held[:] = [t for t in held if now - t < 1.0]
                loads[i] = float(self._inflight.get(r.replica_id, 0) + len(held))
            choice = self._policy.choose(ids, loads, salt)
            self._reserved.setdefault(by_index[choice].replica_id, []).append(now)
            rest = sorted((i for i in by_index if i != choice), key=lambda i: (loads[i], i))
            return [[by_index[choice]]] + [[by_index[i]] for i in rest]

        def on_send_request(self, replica_id) -> None:
            self._inflight[replica_id] = self._inflight.get(replica_id, 0) + 1
            held = self._reserved.get(replica_id)
            if held:
                held.pop(0)
            super().on_send_request(replica_id)

        # A request is counted from its send until Serve reports it completed. Serve (2.60) calls
        # on_request_completed once for every request it sent, accepted or rejected by a replica at
        # its strict max_ongoing_requests (a rejected call is cancelled, which completes it), while
        # decrement_queue_len_cache fires for accepted ones only: counting down there left every
        # rejection counted forever, and prefix routing leaned away from that replica. Older Serve
        # without on_request_completed: decrement_queue_len_cache, the best it offers.
        if hasattr(RequestRouter, "on_request_completed"):
            def on_request_completed(self, replica_id, internal_request_id) -> None:
                self._uncount(replica_id)
                super().on_request_completed(replica_id, internal_request_id)
        else:   # pragma: no cover - Ray < 2.5x
            def decrement_queue_len_cache(self, replica_id) -> None:
                self._uncount(replica_id)
                super().decrement_queue_len_cache(replica_id)

        def _uncount(self, replica_id) -> None:
            if self._inflight.get(replica_id):
                self._inflight[replica_id] -= 1

        def on_replica_actor_died(self, replica_id) -> None:
            self._inflight.pop(replica_id, None)
            if replica_id.unique_id in self._index:   # a replacement starts with an empty cache
                self._policy.forget_replica(self._index[replica_id.unique_id])
            super().on_replica_actor_died(replica_id)

    PrefixRouter.__module__ = __name__
    PrefixRouter.__qualname__ = "PrefixRouter"
    return PrefixRouter


def __getattr__(name: str):   # PrefixRouter needs ray: built on first use
    if name == "PrefixRouter":
        cls = _prefix_router_class()
        globals()["PrefixRouter"] = cls
        return cls
    raise AttributeError(name)


# ---- the application ---------------------------------------------------------------------------

def build_application(config: EngineConfig, *, num_replicas: int | str | None = 1,
                      autoscaling_config: dict | None = None, num_cpus: float | None = None,
                      router: str = "prefix", balance_slack: int = 8, max_waiting: int | None = None,
                      engine_process: bool = False, chat_template: str | None = None,
                      app_options: dict | None = None, ingress_replicas: int = 1):
    """The Serve application: `ConveyorIngress` (HTTP) -> `ConveyorEngine` (num_replicas engines).
    `app_options`: ServerConfig fields for ``build_app`` (api_key, served_model_name, ...)."""
    # lazy: optional dependency (ray)
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    opts = get_deployment_options(config, num_replicas=num_replicas, autoscaling_config=autoscaling_config,
                                  num_cpus=num_cpus)
    if config.torch_threads is None:   # each rank uses the CPUs of its bundle, not every core of its node
        per_rank = max(1, int(opts["placement_group_bundles"][0]["CPU"]))
        spawned = config.distributed_executor_backend == "mp"   # spawned ranks split the replica's threads
        config = replace(config, torch_threads=per_rank * (config.tensor_parallel_size if spawned else 1))
    opts["request_router_config"] = RequestRouterConfig(
        request_router_class=f"{__name__}:PrefixRouter",
        request_router_kwargs={"policy": router, "block_size": config.block_size, "balance_slack": balance_slack})
    engine = serve.deployment(EngineReplica, name=ENGINE_DEPLOYMENT).options(**opts)
    ingress_cls = serve.ingress()(IngressReplica)
    ingress = serve.deployment(ingress_cls, name=INGRESS_DEPLOYMENT).options(
        num_replicas=ingress_replicas, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
    return ingress.bind(engine.bind(config, max_waiting, engine_process, chat_template), app_options)


def app_builder(args: dict) -> Any:
    """``serve run conveyor.ray.serve:app_builder model=... num_replicas=2`` (and the same keys under
    ``args:`` of a Serve config file, deploy/ray/conveyor-serve.yaml)."""
    args = dict(args or {})
    num_replicas = args.pop("num_replicas", 1)
    autoscaling = args.pop("autoscaling_config", None)
    num_cpus = args.pop("num_cpus", None)
    router = args.pop("router", "prefix")
    app_options = args.pop("app_options", None)
    engine_process = bool(args.pop("engine_process", False))
    config = EngineConfig.from_options(**args)
    return build_application(config, num_replicas=int(num_replicas) if str(num_replicas).isdigit() else num_replicas,
                             autoscaling_config=autoscaling, num_cpus=num_cpus and float(num_cpus), router=router,
                             engine_process=engine_process, app_options=app_options)


def run(config: EngineConfig, *, host: str = "127.0.0.1", port: int = 8000, name: str = APP_NAME,
        blocking: bool = False, **kw: Any) -> Any:
    """Start (or connect to, with RAY_ADDRESS) Ray, start Serve's HTTP proxy on host:port and deploy."""
    # lazy: optional dependency (ray)
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True)
    serve.start(http_options={"host": host, "port": port})
    return serve.run(build_application(config, **kw), name=name, route_prefix="/", blocking=blocking)


# What the ingress's app takes from `conveyor serve --ray`'s server flags (the rest act on Ray or the engines).
_INGRESS_OPTIONS = ("served_model_name", "api_key", "max_body_bytes", "shutdown_timeout", "tool_call_parser",
                    "allowed_origins", "reasoning_parser", "responses_max_stored", "responses_max_stored_bytes")


def serve_from_cli(args: Any) -> int:
    """``conveyor serve --ray``: `--data-parallel-size` engine replicas on Ray Serve, Conveyor's API on
    Serve's HTTP proxy at --host/--port; blocks until Ctrl-C / SIGTERM, then shuts the app down."""
    server = server_config_from_args(args)
    logging.basicConfig(level=server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_from_args(args, model=args.model)

    try:
        # lazy: optional dependency (ray)
        import ray
        from ray import serve
    except ImportError as e:
        raise SystemExit("--ray needs Ray Serve: pip install 'conveyor[ray]'") from e
    template = None
    if server.chat_template:
        template = read_chat_template(server.chat_template)
    app_options = {name: getattr(server, name) for name in _INGRESS_OPTIONS}
    stop = threading.Event()   # Ctrl-C / SIGTERM, even while deploying: finish deploying, then remove the app
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    run(config, host=server.host, port=server.port, num_replicas=server.data_parallel_size, router=server.router,
        max_waiting=server.max_waiting or None, engine_process=server.engine_process, chat_template=template,
        app_options=app_options)
    logger.info("Conveyor on Ray Serve: %d engine replica(s), the API at http://%s:%d",
                server.data_parallel_size, server.host, server.port)
    stop.wait()
    serve.delete(APP_NAME)
    ray.shutdown()
    return 0
