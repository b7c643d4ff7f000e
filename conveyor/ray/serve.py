"""Conveyor on Ray Serve: Ray owns the replicas (placement, health checks, restarts, autoscaling).

Two deployments in one Serve application, the same split as Ray Serve LLM's ingress + LLM server:

- ``ConveyorEngine`` (N replicas): each holds one engine (an in-process ``AsyncEngine``, or a
  ``ProcessEngine``) and streams a prompt's outputs as what each adds (``ReplicaDelta``), the
  finished output whole (``ReplicaOutput``), its stats on a request's first and last items and at
  most once a second between. Its resources come from ``get_deployment_options`` (a placement
  bundle of CPUs, plus a GPU on CUDA); Serve's health check fails once the engine is dead, so Serve
  replaces the replica.
- ``ConveyorIngress``: Conveyor's whole FastAPI app (``build_app``: completions, chat, streaming,
  Responses, Messages, tokenize, /metrics...) behind Serve's HTTP proxy, over a ``RayEngineClient``
  (an ``EngineClient``) that sends each tokenized prompt to an engine replica through a Serve
  deployment handle (over gRPC where Serve has it: no object-store round trip per streamed item).

The handle routes with ``PrefixRouter``, a Serve ``RequestRouter`` that applies Conveyor's prefix
policy (``conveyor.routing.Router``, the one the built-in ``--data-parallel-size`` server and
the simulator use) to the prompt's token ids, with each replica's in-flight requests as its load,
and feeds it the replicas' KV cache events (``Router.learn``) as the built-in server does. Routing
at the handle, not at the HTTP proxy, is what makes the prefix visible: the proxy forwards the
ASGI scope and streams the body to the replica later, so a router there never sees the prompt.

``deploy`` is ``serve.run`` bounded in time: a replica that cannot start fails the deployment with
its name and the cause, instead of leaving the caller waiting.

Ray Serve LLM (``ray.serve.llm``, ``LLMConfig(server_cls=...)``) is not used: in Ray 2.60 importing
its protocol models raises "Neither vLLM nor SGLang is installed", so it cannot run a third-party
engine without one of them installed.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, NamedTuple

from conveyor.config import EngineConfig, config_from_args
from conveyor.frontend.client import Overloaded, RequestStream
from conveyor.transport.thread import AsyncEngine
from conveyor.core.engine_core import EngineDeadError
from conveyor.transport.data_parallel import KVEventListener, can_read_kv_events, replica_config
from conveyor.frontend.inputs import InputProcessor, ProcessedRequest, grammar_backend
from conveyor.frontend.output_processor import error_output
from conveyor.frontend.outputs import CompletionOutput, RequestOutput
from conveyor.transport.process import ProcessEngine
from conveyor.core.stats import EngineStats
from conveyor.kv.events import binds, offset_endpoint
from conveyor.lora.request import adapter_key
from conveyor.model.loader import load_tokenizer
from conveyor.routing import Router, policy_name
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler.deadlines import QUEUE_TIMEOUT
from conveyor.server.app import build_app
from conveyor.server.cli import read_chat_template
from conveyor.server.config import server_config_from_args
from conveyor.server.shutdown import EXIT_CUT_SHORT, Signals

logger = logging.getLogger(__name__)

APP_NAME = "conveyor"
ENGINE_DEPLOYMENT = "ConveyorEngine"
INGRESS_DEPLOYMENT = "ConveyorIngress"
STATS_INTERVAL_S = 1.0      # a replica's stats ride its streams at most this often (and on first/last items)
START_TIMEOUT_S = float(os.environ.get("CONVEYOR_RAY_START_TIMEOUT_S", 900))   # deploy(): replicas running by then
CHOICE_LAPSE_S = 1.0        # a replica chosen for a request that was never sent to stops counting after this


# ---- what an engine replica streams ------------------------------------------------------------

@dataclass(slots=True)
class ReplicaOutput:
    """A request's finished output, whole (or its error), with the replica's tag and stats then."""

    replica: str
    stats: EngineStats | None
    output: RequestOutput


class SeqDelta(NamedTuple):
    """What one sequence's running output adds to the previous one (CompletionOutput's delta fields)."""

    index: int
    delta_text: str
    delta_token_ids: tuple[int, ...]
    finish_reason: str | None
    stop_reason: int | str | None
    cumulative_logprob: float | None
    delta_logprobs: tuple | None


class ReplicaDelta(NamedTuple):
    """A request's running output as what changed: never its prompt, text so far or history again.
    `replica` on the request's first item; `stats` then and at most every STATS_INTERVAL_S;
    `prompt_logprobs` once, on the first item that has them."""

    seqs: tuple[SeqDelta, ...]
    num_cached_tokens: int
    prompt_logprobs: list | None = None
    replica: str | None = None
    stats: EngineStats | None = None


def delta_of(out: RequestOutput, *, prompt_logprobs: bool, replica: str | None,
             stats: EngineStats | None) -> ReplicaDelta:
    seqs = tuple(SeqDelta(c.index, c.delta_text, c.delta_token_ids, c.finish_reason, c.stop_reason,
                          c.cumulative_logprob, c.delta_logprobs) for c in out.outputs)
    return ReplicaDelta(seqs, out.num_cached_tokens, out.prompt_logprobs if prompt_logprobs else None, replica, stats)


class OutputRebuilder:
    """A request's running outputs rebuilt on the ingress from its replica's deltas: each sequence's
    text so far from its deltas, the prompt from the request, prompt logprobs kept from the item
    that brought them. What the HTTP layer reads from a running output is all there."""

    def __init__(self, request_id: str, request: ProcessedRequest):
        self.request_id, self.request = request_id, request
        self.texts: dict[int, str] = {}
        self.prompt_logprobs: list | None = None

    def __call__(self, delta: ReplicaDelta) -> RequestOutput:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        outputs = [self._completion(s) for s in delta.seqs]
        return RequestOutput(self.request_id, self.request.prompt, self.request.prompt_token_ids, outputs, False,
                             num_cached_tokens=delta.num_cached_tokens, prompt_logprobs=self.prompt_logprobs)

    def _completion(self, s: SeqDelta) -> CompletionOutput:
        text = self.texts[s.index] = self.texts.get(s.index, "") + s.delta_text
        return CompletionOutput(s.index, text, None, None, s.finish_reason, s.stop_reason, s.delta_text,
                                s.delta_token_ids, s.cumulative_logprob, s.delta_logprobs)


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
    """One engine per replica; `generate` streams a request's ReplicaDeltas, then its ReplicaOutput."""

    def __init__(self, config: EngineConfig, max_waiting: int | None = None, engine_process: bool = False,
                 chat_template: str | None = None, events_for_router: bool = False):
        from ray import serve   # lazy: optional dependency (ray)

        context = serve.get_replica_context()
        self.tag = context.replica_id.unique_id
        rank = getattr(context, "rank", None)   # Serve's replica rank (recent Serve): 0..N-1, kept by a replacement
        self.rank = int(getattr(rank, "rank", rank) or 0)
        self._event_dir: str | None = None
        if events_for_router and not config.kv_events_endpoint:
            # no endpoint of the user's: a private ipc socket, which the router reads on this node
            self._event_dir = tempfile.mkdtemp(prefix="conveyor-kv-")
            config = replace(config, kv_events_endpoint=f"ipc://{self._event_dir}/events")
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
        self._stats_sent = 0.0   # when stats last rode a stream
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
        """The request's outputs: ReplicaDeltas while it runs, then a ReplicaOutput (the front end
        processed it: not checked again here)."""
        try:
            stream = self.engine.add_request(request, None, request_id, priority)
        except Overloaded as e:
            yield self._whole(error_output(request_id, str(e), code=QUEUE_TIMEOUT))
            return
        except EngineDeadError as e:
            yield self._whole(error_output(request_id, str(e)))
            return
        first, logprobs_sent = True, False
        try:
            async for out in stream:
                if out.finished:
                    yield self._whole(out)
                    continue
                with_logprobs = not logprobs_sent and out.prompt_logprobs is not None
                logprobs_sent |= with_logprobs
                yield delta_of(out, prompt_logprobs=with_logprobs, replica=self.tag if first else None,
                               stats=self._stats_due(first))
                first = False
        finally:   # cancelled by the caller (client gone, abort): free the KV blocks now
            if not stream.finished:
                self.engine.abort(request_id)

    def _whole(self, out: RequestOutput) -> ReplicaOutput:
        return ReplicaOutput(self.tag, self._stats_due(True), out)

    def _stats_due(self, now_anyway: bool) -> EngineStats | None:
        """The engine's stats if a stream should carry them now, else None."""
        now = time.monotonic()
        if not now_anyway and now - self._stats_sent < STATS_INTERVAL_S:
            return None
        self._stats_sent = now
        return self.engine.stats()

    def reconfigure(self, user_config: Any = None, rank: Any = None) -> None:
        """Serve's reconfigure hook. After a scale-down Serve renumbers its replicas' ranks; this replica
        keeps publishing KV events as the rank it started with (its ports are bound), so it says so."""
        new = getattr(rank, "rank", rank)
        if new is not None and int(new) != self.rank and self.config.kv_events_endpoint and not self._event_dir:
            logger.warning("engine replica %s: Serve renumbered it to rank %s; its KV events keep dp_rank %d and "
                           "their ports (a new replica given rank %d on this node cannot bind them)",
                           self.tag, new, self.rank, self.rank)

    def engine_kv_events(self) -> dict | None:
        """Where this replica publishes KV events (None: off): its dp_rank, its node's address, the
        endpoints it bound (the configured ports + its rank) and the topic, for a subscriber."""
        if not self.config.kv_events_endpoint:
            return None
        import ray   # lazy: optional dependency (ray)

        return {"dp_rank": self.rank, "node_ip": ray.util.get_node_ip_address(),
                "endpoint": offset_endpoint(self.config.kv_events_endpoint, self.rank),
                "replay_endpoint": offset_endpoint(self.config.kv_events_replay_endpoint, self.rank),
                "topic": self.config.kv_events_topic}

    def record_replica_metadata(self) -> dict[str, Any]:
        """Serve's per-replica metadata hook (``RunningReplica.replica_metadata``, recent Serve): where
        the request router reads this replica's KV events."""
        return {"kv_events": self.engine_kv_events()}

    def stats(self) -> tuple[str, EngineStats]:
        return self.tag, self.engine.stats()

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve's routing stats hook (``RunningReplica.routing_stats``; the KV events' endpoint also
        here for a Serve without ``replica_metadata``)."""
        s = self.engine.stats()
        return {"num_unfinished_requests": s.num_unfinished_requests, "kv_usage": s.kv_usage,
                "prefix_cache_hits": s.prefix_cache_hits, "prefix_cache_queries": s.prefix_cache_queries,
                "kv_events": self.engine_kv_events()}

    def check_health(self) -> None:
        """Serve's health check: a dead engine makes Serve replace this replica."""
        if not self.engine.is_healthy:
            raise RuntimeError(f"the engine is not running: {self.engine.dead_reason}")

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
        if getattr(self, "_event_dir", None):
            shutil.rmtree(self._event_dir, ignore_errors=True)


# ---- the live replicas, as the request router sees them ----------------------------------------

# (app, deployment) -> the tags of the replicas Serve routes to now. The request router (in the
# ingress's process, beside the RayEngineClient) writes it; the client's health reads it, so a
# replica that died or was scaled away is flagged down even when no request of ours saw it go.
_live_replicas: dict[tuple[str, str], frozenset[str]] = {}


# ---- the front end's engine client -------------------------------------------------------------

class RayEngineClient:
    """An ``EngineClient`` whose engines are the replicas of a Serve deployment (through `handle`).

    Validation and tokenization happen here (the HTTP layer's usual path); each request is one
    streaming call to a replica, chosen by the handle's request router. A replica that dies fails
    its in-flight requests (an error output, as for a dead engine); Serve starts another.
    Per-replica stats (for /metrics, with a ``replica`` label) are as of each replica's latest report;
    a replica that is gone keeps its counters and is flagged down (no load gauges on /metrics).
    """

    def __init__(self, handle: Any, info: dict):
        self._generate = _streaming(handle).generate
        self._deployment = (handle.app_name, handle.deployment_name)
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
        self._replicas: OrderedDict[str, EngineStats] = OrderedDict()   # tag -> latest stats
        self._died: set[str] = set()   # replicas seen failing a request because their actor died
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
        """The live replicas' stats combined; unfinished requests: this client's own."""
        live = [s for s, up in zip(self.replica_stats(), self.replica_health()) if up]
        return EngineStats.combine(live).replace(num_unfinished_requests=len(self._tasks))

    def replica_stats(self) -> list[EngineStats]:
        return list(self._replicas.values()) or [EngineStats()]

    def replica_health(self) -> list[bool]:
        live = _live_replicas.get(self._deployment)
        return [tag not in self._died and (live is None or tag in live) for tag in self._replicas] or [True]

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
        rebuild = OutputRebuilder(request_id, request)
        try:
            _own_serve_request_id()
            gen = self._generate.remote(request, request_id, priority)
            async for item in gen:
                if item.replica is not None and tag is None:
                    tag = item.replica
                    self._served(request_id, tag)
                if item.stats is not None:
                    self._replicas[tag] = item.stats
                out = item.output if isinstance(item, ReplicaOutput) else rebuild(item)
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
                self._died.add(tag)   # its last stats stay (counters keep their totals), flagged down
            logger.warning("request %s failed on engine replica %s: %s", request_id, tag, message)
            self._put(stream, error_output(request_id, f"the engine replica failed ({type(e).__name__}): {message}"))
        finally:
            self._tasks.pop(request_id, None)

    def _served(self, request_id: str, tag: str) -> None:
        self._replicas.setdefault(tag, EngineStats())
        self.served_by[request_id] = tag
        while len(self.served_by) > 10_000:
            self.served_by.popitem(last=False)

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


def _streaming(handle: Any) -> Any:
    """The handle, streaming, over gRPC where this Serve can (``_by_reference=False``, what Serve's
    RAY_SERVE_USE_GRPC_BY_DEFAULT sets): each streamed item then goes replica -> caller directly, not
    through the object store and the owner's bookkeeping; measured to cut the ingress's and the
    replicas' CPU per streamed token by about half (docs/scale-out.md)."""
    if "_by_reference" in inspect.signature(handle.options).parameters:
        return handle.options(stream=True, _by_reference=False)
    return handle.options(stream=True)


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
        self.conveyor_app = None   # (not `app`: Serve's ingress wrapper has a read-only property of that name)

    async def __serve_build_asgi_app__(self):
        info = await self._handle.info.remote()
        self.client = RayEngineClient(self._handle, info)
        self.conveyor_app = build_app(self.client, **{"log_interval": 0, **self._app_options})
        return self.conveyor_app

    async def drain(self, cut: bool = False) -> bool:
        """`conveyor serve --ray`'s shutdown, called by its driver (conveyor/server/shutdown.py): the first
        call stops taking requests and waits for those in flight, up to the app's shutdown_timeout; one with
        `cut` aborts them now. True if requests were aborted."""
        drain = self.conveyor_app.state.drain
        if cut:
            drain.cut()
        return await drain.wait()


# ---- the request router ------------------------------------------------------------------------

@dataclass(slots=True)
class ReplicaLoad:
    """One replica's requests from this handle, by stage: chosen for it and not yet sent (request id
    -> when; lapses after CHOICE_LAPSE_S), sent with its acceptance not yet known, accepted and not
    completed (by request id). Counting accepted requests by id is what keeps every path even: a
    completion for a request never sent, or one counted elsewhere, takes nothing away."""

    chosen: dict[str, float] = field(default_factory=dict)
    sending: int = 0
    accepted: set[str] = field(default_factory=set)

    def count(self, now: float) -> int:
        for rid in [r for r, t in self.chosen.items() if now - t >= CHOICE_LAPSE_S]:
            del self.chosen[rid]
        return len(self.chosen) + self.sending + len(self.accepted)

    def sent(self) -> None:
        self.sending += 1
        if self.chosen:   # the oldest choice of this replica was the one sent, most likely
            del self.chosen[next(iter(self.chosen))]

    def routed(self, rid: str) -> None:
        self.sending = max(0, self.sending - 1)
        self.chosen.pop(rid, None)
        self.accepted.add(rid)

    def completed(self, rid: str | None) -> None:
        if rid is None:   # (Serve without request ids at completion: one fewer, whichever it was)
            if self.accepted:
                self.accepted.pop()
            elif self.sending:
                self.sending -= 1
            return
        if rid in self.accepted:
            self.accepted.discard(rid)
        elif self.sending:   # rejected at the replica's limit, or sent without Serve's rejection protocol
            self.sending -= 1
        self.chosen.pop(rid, None)


def _prefix_router_class():
    from ray.serve.request_router import RequestRouter   # lazy: optional dependency (ray)

    class PrefixRouter(RequestRouter):
        """Conveyor's routing policy over Serve's replicas: the prompt's token ids (the first argument
        of ``generate``), each replica's requests from this handle (ReplicaLoad) and, when the replicas
        publish them, their KV cache events (``Router.learn``, as the built-in server's router)."""

        def initialize_state(self, policy: str = "prefix", block_size: int = 16, prefix_blocks: int = 4,
                             balance_slack: int = 8, **_: Any) -> None:
            self._policy = Router(policy, block_size, prefix_blocks, balance_slack)
            self._lock = threading.Lock()   # the event listeners' threads learn while this loop chooses
            self._index: dict[str, int] = {}   # replica tag -> stable index for the policy
            self._loads: dict[Any, ReplicaLoad] = {}   # replica id -> its requests from this handle
            self._events: dict[str, KVEventListener] = {}   # replica tag -> its KV events' listener

        async def choose_replicas(self, candidate_replicas, pending_request=None):
            if not candidate_replicas:
                return []
            ids: list[int] = []
            salt = adapter = None
            if pending_request is not None and pending_request.args:
                first = pending_request.args[0]   # generate(request, ...): the front end's ProcessedRequest
                if isinstance(first, ProcessedRequest):
                    ids, salt, adapter = first.prompt_token_ids, first.cache_salt, adapter_key(first.lora)
            by_index = {self._index_of(r.replica_id.unique_id): r for r in candidate_replicas}
            loads: list[float | None] = [None] * len(self._index)
            for i, r in by_index.items():
                loads[i] = float(self.in_flight(r.replica_id))
            with self._lock:
                choice = self._policy.choose(ids, loads, salt, adapter)
            rid = _request_id(pending_request)
            if rid is not None:
                self._load(by_index[choice].replica_id).chosen[rid] = time.monotonic()
            rest = sorted((i for i in by_index if i != choice), key=lambda i: (loads[i], i))
            return [[by_index[choice]]] + [[by_index[i]] for i in rest]

        def in_flight(self, replica_id) -> int:
            """This handle's requests counted on a replica now: chosen for it, being sent, or running there."""
            return self._load(replica_id).count(time.monotonic())

        def on_send_request(self, replica_id) -> None:
            self._load(replica_id).sent()
            super().on_send_request(replica_id)

        def on_request_routed(self, pending_request, replica_id, result) -> None:
            rid = _request_id(pending_request)
            if rid is not None:
                self._load(replica_id).routed(rid)
            super().on_request_routed(pending_request, replica_id, result)

        # Serve (2.60) calls on_request_completed once for every request it sent, accepted or rejected by a
        # replica at its strict max_ongoing_requests (a rejected call is cancelled, which completes it), and
        # also for one it chose a replica for but failed to send; decrement_queue_len_cache fires for
        # accepted ones only. Older Serve without on_request_completed: decrement_queue_len_cache.
        if hasattr(RequestRouter, "on_request_completed"):
            def on_request_completed(self, replica_id, internal_request_id) -> None:
                self._load(replica_id).completed(internal_request_id)
                super().on_request_completed(replica_id, internal_request_id)
        else:   # pragma: no cover - Ray < 2.5x
            def decrement_queue_len_cache(self, replica_id) -> None:
                self._load(replica_id).completed(None)
                super().decrement_queue_len_cache(replica_id)

        def update_replicas(self, replicas) -> None:
            super().update_replicas(replicas)
            tags = {r.replica_id.unique_id for r in replicas}
            _live_replicas[(self._deployment_id.app_name, self._deployment_id.name)] = frozenset(tags)
            for r in replicas:
                self._listen(r)
            for tag in [t for t in self._events if t not in tags]:
                self._stop_listening(tag)

        def on_replica_actor_died(self, replica_id) -> None:
            self._loads.pop(replica_id, None)
            key = (self._deployment_id.app_name, self._deployment_id.name)
            _live_replicas[key] = _live_replicas.get(key, frozenset()) - {replica_id.unique_id}
            self._stop_listening(replica_id.unique_id)
            if replica_id.unique_id in self._index:   # a replacement starts with an empty cache
                with self._lock:
                    self._policy.forget_replica(self._index[replica_id.unique_id])
            super().on_replica_actor_died(replica_id)

        def _index_of(self, tag: str) -> int:
            return self._index.setdefault(tag, len(self._index))

        def _load(self, replica_id) -> ReplicaLoad:
            load = self._loads.get(replica_id)
            if load is None:
                load = self._loads[replica_id] = ReplicaLoad()
            return load

        def _listen(self, replica) -> None:
            """Subscribe to a replica's KV events, where it publishes them and they reach this node."""
            tag = replica.replica_id.unique_id
            if tag in self._events or self._policy.policy != "prefix":
                return
            where = kv_events_of(replica)
            endpoint = subscribe_endpoint(where)
            if endpoint is None:
                return
            index = self._index_of(tag)
            try:
                self._events[tag] = KVEventListener([endpoint], where.get("topic") or "",
                                                    lambda _, events, lost: self._learn(index, events, lost))
            except Exception:   # noqa: BLE001 - routing goes on by where prefixes were sent
                logger.exception("cannot subscribe to the KV events of engine replica %s at %s", tag, endpoint)

        def _learn(self, index: int, events: list, lost: bool) -> None:
            with self._lock:
                if lost:   # what it holds is no longer known: forget it, then learn again from here
                    self._policy.forget_replica(index)
                self._policy.learn(index, events)

        def _stop_listening(self, tag: str) -> None:
            listener = self._events.pop(tag, None)
            if listener is not None:
                listener.close()

    PrefixRouter.__module__ = __name__
    PrefixRouter.__qualname__ = "PrefixRouter"
    return PrefixRouter


def _request_id(pending_request: Any) -> str | None:
    metadata = getattr(pending_request, "metadata", None)
    return getattr(metadata, "internal_request_id", None)


def kv_events_of(replica: Any) -> dict:
    """Where a replica (Serve's RunningReplica) publishes its KV events: its metadata, else its routing
    stats (a Serve without replica metadata; they arrive with its first stats poll); {} when off."""
    metadata = getattr(replica, "replica_metadata", None) or {}
    return metadata.get("kv_events") or (getattr(replica, "routing_stats", None) or {}).get("kv_events") or {}


def subscribe_endpoint(where: dict) -> str | None:
    """The address to subscribe at for a replica's published endpoint (a wildcard bind becomes its
    node's address; an ipc socket only on the same node); None where the replica connects out to a
    subscriber of its own (its endpoint does not bind) or publishes nothing."""
    import ray   # lazy: optional dependency (ray)

    endpoint = where.get("endpoint")
    if not endpoint or not binds(endpoint) or endpoint.startswith("inproc://"):
        return None
    node = where.get("node_ip")
    if endpoint.startswith("ipc://"):
        return endpoint if node in (None, ray.util.get_node_ip_address()) else None
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:"):
        if endpoint.startswith(wildcard) and node:
            host = f"[{node}]" if ":" in node else node
            return f"tcp://{host}:{endpoint[len(wildcard):]}"
    return endpoint


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
    `app_options`: ServerConfig fields for ``build_app`` (api_key, served_model_name, ...). With the
    prefix router, the replicas publish KV events for it (on a private socket each, unless the config
    names an endpoint)."""
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
    opts["ray_actor_options"] = one_loop(opts["ray_actor_options"])
    engine = serve.deployment(EngineReplica, name=ENGINE_DEPLOYMENT).options(**opts)
    ingress_cls = serve.ingress()(IngressReplica)
    ingress = serve.deployment(ingress_cls, name=INGRESS_DEPLOYMENT).options(
        num_replicas=ingress_replicas, ray_actor_options=one_loop({"num_cpus": 0}), max_ongoing_requests=1000)
    events = policy_name(router) == "prefix" and can_read_kv_events()
    return ingress.bind(engine.bind(config, max_waiting, engine_process, chat_template, events), app_options)


# Serve's own switches (its "throughput optimized" set, less direct ingress) for our replicas' processes:
# user code on the replica's event loop instead of a thread of its own, the handle's router on that
# loop too. Every streamed item otherwise crosses threads twice (router loop -> user loop, user loop ->
# the replica's loop), which cost more CPU per token than the item itself; our code there never blocks
# for long (the engine steps in its own process or thread).
ONE_LOOP_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


def one_loop(actor_options: dict) -> dict:
    """`actor_options` with ONE_LOOP_ENV in its runtime env (a variable already set there wins)."""
    env = dict(actor_options.get("runtime_env", {}).get("env_vars", {}))
    runtime_env = {**actor_options.get("runtime_env", {}), "env_vars": {**ONE_LOOP_ENV, **env}}
    return {**actor_options, "runtime_env": runtime_env}


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


# ---- bounded start-up --------------------------------------------------------------------------

class DeployError(RuntimeError):
    """The application's replicas did not all start: which ones, and why."""


def deploy(app: Any, *, name: str = APP_NAME, route_prefix: str | None = "/",
           timeout_s: float = START_TIMEOUT_S, poll_s: float = 0.5) -> Any:
    """``serve.run(app)``, bounded: the handle once every deployment runs; DeployError, with the app
    deleted, when one fails to start or `timeout_s` passes first, naming each replica not running and
    its cause (a placement the cluster cannot hold, a constructor that raised or has not returned).
    Serve itself waits forever for a replica it cannot place. ``serve._run(_blocking=False)``: a
    private Serve API (Ray 2.60) for deploying without that wait."""
    from ray import serve   # lazy: optional dependency (ray)

    handle = serve._run(app, _blocking=False, name=name, route_prefix=route_prefix)
    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications.get(name)
        state = _state(getattr(status, "status", None))
        if state == "RUNNING":
            return handle
        if state == "DEPLOY_FAILED" or time.monotonic() > deadline:
            why = not_running(name, status)
            serve.delete(name)
            when = "failed to start" if state == "DEPLOY_FAILED" else f"did not start within {timeout_s:g} s"
            raise DeployError(f"Serve application {name!r} {when}: {why}")
        time.sleep(poll_s)


def not_running(name: str, status: Any) -> str:
    """Why application `name` is not running: each of its replicas that Ray cannot place (from the
    placement groups: what it needs, what the cluster has), then each deployment not yet healthy
    with its replicas' states and Serve's last word on it (a constructor's error)."""
    import ray   # lazy: optional dependency (ray)

    total = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
    parts, unplaced = [], set()
    for pg in ray.util.placement_group_table().values():
        replica = pg.get("name", "")
        if replica.startswith(f"SERVE_REPLICA::{name}#") and pg.get("state") == "PENDING":
            unplaced.add(replica.split("#")[1])
            how = (pg.get("stats") or {}).get("scheduling_state") or pg.get("state")
            parts.append(f"replica {replica.split('::', 1)[1]} cannot be placed ({how}): it needs "
                         f"{list(pg.get('bundles', {}).values())}, the cluster has {total}")
    for dep, s in (getattr(status, "deployments", None) or {}).items():
        if _state(s.status) == "HEALTHY":
            continue
        lines = (s.message or "").strip().splitlines()
        said = lines[-1] if lines else ("" if dep in unplaced else "placed, its constructor has not returned")
        parts.append(f"deployment {dep} {dict(s.replica_states)}" + (f": {said}" if said else ""))
    return "; ".join(parts) or "Serve reported no cause"


def _state(status: Any) -> str:
    """An application's or deployment's status (a str Enum in Serve) as its bare name."""
    return str(getattr(status, "value", status))


def run(config: EngineConfig, *, host: str = "127.0.0.1", port: int = 8000, name: str = APP_NAME,
        blocking: bool = False, **kw: Any) -> Any:
    """Start (or connect to, with RAY_ADDRESS) Ray, start Serve's HTTP proxy on host:port and deploy, within
    START_TIMEOUT_S (DeployError naming the replicas that did not start); `blocking`: then wait for Ctrl-C."""
    # lazy: optional dependency (ray)
    import ray
    from ray import serve

    if not ray.is_initialized():
        init_ray()
    serve.start(http_options={"host": host, "port": port})
    handle = deploy(build_application(config, **kw), name=name, route_prefix="/")
    if blocking:
        threading.Event().wait()
    return handle


def init_ray() -> None:
    """ray.init (RAY_ADDRESS: connect to a cluster). Serve's proxy calls the replicas over gRPC unless told
    otherwise (RAY_SERVE_PROXY_USE_GRPC=0): less of its CPU per streamed token than its default (a local
    Ray reads this here; on a cluster it is `ray start`'s environment that counts)."""
    import ray   # lazy: optional dependency (ray)

    os.environ.setdefault("RAY_SERVE_PROXY_USE_GRPC", "1")
    ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True)


# What the ingress's app takes from `conveyor serve --ray`'s server flags (the rest act on Ray or the engines).
_INGRESS_OPTIONS = ("served_model_name", "api_key", "max_body_bytes", "shutdown_timeout", "tool_call_parser",
                    "allowed_origins", "reasoning_parser", "responses_max_stored", "responses_max_stored_bytes")


def serve_from_cli(args: Any) -> int:
    """``conveyor serve --ray``: `--data-parallel-size` engine replicas on Ray Serve, Conveyor's API on
    Serve's HTTP proxy at --host/--port; blocks until Ctrl-C / SIGTERM, then shuts down as ``conveyor serve``
    does (conveyor/server/shutdown.py): the ingress drains (a second signal cuts the drain), then the app
    is deleted and Ray shut down. Returns 0 after a clean drain, EXIT_CUT_SHORT if requests were aborted."""
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
    if not ray.is_initialized():   # before the signals are taken over: ray.init installs a SIGTERM handler that exits
        init_ray()
    # Ctrl-C / SIGTERM, even while deploying: finish deploying, then drain
    drain, cut = threading.Event(), threading.Event()

    def on_signal(sig: int, count: int) -> None:
        name = signal.Signals(sig).name
        if count == 1:
            logger.warning("%s: draining; requests in flight get up to %g s to finish (a second signal "
                           "aborts them now)", name, server.shutdown_timeout)
        else:
            logger.warning("%s during the drain: aborting the requests in flight", name)
        (drain if count == 1 else cut).set()

    Signals.install().attach(on_signal)
    run(config, host=server.host, port=server.port, num_replicas=server.data_parallel_size, router=server.router,
        max_waiting=server.max_waiting or None, engine_process=server.engine_process, chat_template=template,
        app_options=app_options)
    logger.info("Conveyor on Ray Serve: %d engine replica(s), the API at http://%s:%d",
                server.data_parallel_size, server.host, server.port)
    while not drain.is_set():   # (polled: Event.wait holds a lock that the signal handler's set() would take)
        time.sleep(0.2)
    # The ingress's own drain (its app's, as in `conveyor serve`); Serve's graceful shutdown alone would
    # route new requests nowhere (404) and kill streams still open at its timeout without an error event.
    ingress = serve.get_deployment_handle(INGRESS_DEPLOYMENT, APP_NAME)
    draining, cut_sent, cut_short = ingress.drain.remote(), False, False
    while True:
        try:
            cut_short = draining.result(timeout_s=0.2)
            break
        except TimeoutError:
            if cut.is_set() and not cut_sent:
                ingress.drain.remote(cut=True)
                cut_sent = True
        except Exception:   # noqa: BLE001 - whatever went wrong, the app must still go
            logger.exception("the ingress could not drain; deleting the app")
            cut_short = True
            break
    serve.delete(APP_NAME)
    ray.shutdown()
    return EXIT_CUT_SHORT if cut_short else 0
