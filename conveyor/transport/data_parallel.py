"""Data parallelism: N engine replicas (processes, each with its own KV cache) behind one server.

``DataParallelEngine`` is an ``EngineClient`` like the single-engine ones: the HTTP layer does not
know it talks to several engines. Each request goes to one replica, chosen by a ``Router``: the
policy of ``conveyor/routing.py`` (shared with the simulator), with this engine's error when every
replica is down:

- ``round-robin``: the next live replica in turn;
- ``least-load``: the live replica with the fewest unfinished requests (KV usage breaks ties);
- ``prefix`` (default): the replica whose cache holds (or, until its KV events say so, that was
  last sent) the longest matching prompt prefix (the KV cache's keys of the first
  1..``prefix_blocks`` blocks, the cache salt included, so requests sharing a system prompt or a
  few-shot preamble meet their cached blocks), unless it has ``balance_slack`` more unfinished
  requests than the least loaded live replica — then least-load, and the prefix moves there.
  What each replica holds comes from its KV cache events (vLLM's wire format, what llm-d's
  indexer reads): this process subscribes to every replica's stream (``KVEventListener``) — the
  stream the user configured with ``--kv-events-endpoint`` where it is bound here, else a
  private ipc socket per replica — so a prefix cached on a replica the router did not send it
  to is found, and one evicted from its home but held by another replica goes to the holder.

A replica whose process dies fails its own in-flight requests with a clear error (not retried:
a partly streamed answer cannot be replayed invisibly); the router stops sending it requests,
/health reports it down, and the others go on.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Callable

from conveyor import routing
from conveyor.config import EngineConfig
from conveyor.frontend.client import Overloaded, RequestStream
from conveyor.core.engine_core import EngineDeadError
from conveyor.frontend.inputs import ProcessedRequest
from conveyor.frontend.outputs import RequestOutput
from conveyor.transport.process import ProcessEngine
from conveyor.core.stats import EngineStats
from conveyor.kv.events import binds, offset_endpoint
from conveyor.lora.request import adapter_key
from conveyor.routing import POLICIES, NoReplicaError, replica_load
from conveyor.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

ROUTERS = POLICIES


class Router(routing.Router):
    """The shared routing policy (conveyor/routing.py); EngineDeadError when every replica is down."""

    def choose(self, token_ids: Sequence[int], loads: Sequence[float | None], cache_salt: str | None = None,
               adapter: str | None = None) -> int:
        try:
            return super().choose(token_ids, loads, cache_salt, adapter)
        except NoReplicaError as e:
            raise EngineDeadError(str(e)) from None


def replica_config(config: EngineConfig, rank: int, own_trace: bool = True) -> EngineConfig:
    """Replica `rank`'s config: its rank (its own KV-event ports) and, with `own_trace`, its own
    step-trace file (NAME.replicaR.json beside NAME.json: each replica records its own steps)."""
    config = replace(config, data_parallel_rank=rank)
    if config.step_trace and own_trace:
        path = Path(config.step_trace)
        config = replace(config, step_trace=str(path.with_name(f"{path.stem}.replica{rank}{path.suffix}")))
    return config


class DataParallelEngine:
    """N ProcessEngine replicas behind the EngineClient protocol; see the module docstring."""

    def __init__(self, config: EngineConfig, replicas: int, router: str = "prefix",
                 max_waiting: int | None = None, balance_slack: int = 8):
        if replicas < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {replicas}")
        threads = config.torch_threads or max(1, (os.cpu_count() or 1) // (replicas * config.tensor_parallel_size))
        config = replace(config, torch_threads=threads)
        listen: list[str] | None = None
        self._event_dir: str | None = None   # the private ipc sockets' directory, removed at close
        if routing.policy_name(router) == "prefix" and replicas > 1:   # the router learns from the KV events
            config, listen, self._event_dir = events_for_router(config, replicas)
        per_replica_waiting = None if max_waiting is None else max(1, math.ceil(max_waiting / replicas))
        with ThreadPoolExecutor(replicas) as pool:   # replicas load their models at the same time
            futures = [pool.submit(ProcessEngine, replica_config(config, i, own_trace=replicas > 1),
                                   per_replica_waiting) for i in range(replicas)]
            errors = [f.exception() for f in futures]
        started = [f.result() for f, e in zip(futures, errors) if e is None]
        if any(errors):
            for r in started:
                r.close()
            self._stop_listening()
            raise next(e for e in errors if e is not None)
        self.replicas = started
        first = started[0]
        self.model_name, self.max_model_len, self.tokenizer = first.model_name, first.max_model_len, first.tokenizer
        self.dtype, self.generation_defaults = first.dtype, first.generation_defaults
        self.inputs = first.inputs   # one model: a request processed here is valid on every replica
        self.router = Router(router, config.block_size, balance_slack=balance_slack)
        self._lock = threading.Lock()
        self._owner: dict[str, int] = {}   # request id -> replica, while unfinished
        for i, r in enumerate(started):
            r.add_finished_listener(self._forget)
        self._reported_down: set[int] = set()
        self.events: KVEventListener | None = None
        if listen is not None:
            self.events = KVEventListener(listen, config.kv_events_topic, self._learn)

    # ---- EngineClient ------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int] | dict | ProcessedRequest, params: SamplingParams | None,
                    request_id: str, priority: int = 0) -> RequestStream:
        """Processed once here (tokenized: the router reads the token ids), then sent to one replica."""
        if not isinstance(prompt, ProcessedRequest):
            prompt = self.inputs.process(prompt, params)
        with self._lock:
            if request_id in self._owner:
                raise ValueError(f"duplicate request id {request_id!r}")
            loads = self.loads()
            order = [self.router.choose(prompt.prompt_token_ids, loads, prompt.cache_salt, adapter_key(prompt.lora))]
            order += sorted((i for i, load in enumerate(loads) if load is not None and i != order[0]),
                            key=lambda i: loads[i])
            last: Exception | None = None
            for i in order:   # the router's choice; if it is full, the least loaded others
                try:
                    stream = self.replicas[i].add_request(prompt, None, request_id, priority)
                except (Overloaded, EngineDeadError) as e:
                    last = e
                    continue
                self._owner[request_id] = i
                return stream
            raise last if last is not None else EngineDeadError("every engine replica is down")

    def abort(self, request_id: str) -> None:
        with self._lock:
            i = self._owner.get(request_id)
        if i is not None:
            self.replicas[i].abort(request_id)

    def stats(self) -> EngineStats:
        """The replicas' stats summed (kv_usage: the mean; engine_dead: all of them dead)."""
        return EngineStats.combine(self.replica_stats())

    def replica_stats(self) -> list[EngineStats]:
        return [r.stats() for r in self.replicas]

    def replica_health(self) -> list[bool]:
        health = [r.is_healthy for r in self.replicas]
        for i, ok in enumerate(health):
            if not ok and i not in self._reported_down and self.replicas[i].dead_reason is not None:
                self._reported_down.add(i)
                logger.error("engine replica %d is down: %s", i, self.replicas[i].dead_reason)
        return health

    def loads(self) -> list[float | None]:
        """Per replica: unfinished requests (+ KV usage as a tie-break), or None when it is down."""
        out: list[float | None] = []
        for ok, s in zip(self.replica_health(), self.replica_stats()):
            out.append(replica_load(s.num_unfinished_requests, s.kv_usage) if ok else None)
        return out

    def add_finished_listener(self, listener: Callable[[RequestOutput], None]) -> None:
        for r in self.replicas:
            r.add_finished_listener(listener)

    @property
    def is_healthy(self) -> bool:
        """True while at least one replica serves."""
        return any(self.replica_health())

    @property
    def dead_reason(self) -> str | None:
        if self.is_healthy:
            return None
        reasons = [r.dead_reason for r in self.replicas]
        if all(reason is None for reason in reasons):
            return None   # a clean shutdown
        return "; ".join(f"replica {i}: {reason or 'stopped'}" for i, reason in enumerate(reasons))

    async def shutdown(self, timeout: float = 30.0) -> None:
        await asyncio.gather(*(r.shutdown(timeout) for r in self.replicas))
        self._stop_listening()

    def close(self, timeout: float = 0.0) -> None:
        for r in self.replicas:
            r.close(timeout)
        self._stop_listening()

    def _stop_listening(self) -> None:
        events, self.events = getattr(self, "events", None), None
        if events is not None:
            events.close()
        folder, self._event_dir = getattr(self, "_event_dir", None), None
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)

    def _learn(self, replica: int, events: list, lost: bool) -> None:
        """A replica's batch of KV events, for the router (`lost`: batches before it were missed)."""
        with self._lock:
            if lost:   # what it holds is no longer known: forget it, then learn again from here
                logger.warning("KV events of replica %d were lost; the router forgets what it held", replica)
                self.router.forget_replica(replica)
            self.router.learn(replica, events)

    # ---- internals ---------------------------------------------------------------------------
    def _forget(self, out: RequestOutput) -> None:
        with self._lock:
            self._owner.pop(out.request_id, None)


def events_for_router(config: EngineConfig, replicas: int) -> tuple[EngineConfig, list[str] | None, str | None]:
    """The config with the replicas' KV events on, where this process subscribes to each replica's
    (None: it cannot, and the prefix router goes by where it sent prefixes) and the directory of
    private sockets to remove at close. Events the user publishes on a bound endpoint are read there
    (tcp wildcards through the loopback); without an endpoint, each replica publishes on an ipc
    socket in a private temporary directory."""
    if not can_read_kv_events():
        return config, None, None
    endpoint, folder = config.kv_events_endpoint, None
    if endpoint is None:
        folder = tempfile.mkdtemp(prefix="conveyor-kv-")
        endpoint = f"ipc://{folder}/events"
        config = replace(config, kv_events_endpoint=endpoint)
    elif not binds(endpoint) or endpoint.startswith("inproc://"):
        logger.info("KV events go to %s; the prefix router goes by where it sent prefixes", endpoint)
        return config, None, None
    listen = [offset_endpoint(endpoint, i) for i in range(replicas)]
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
        listen = [ep.replace(wildcard, "tcp://127.0.0.1:") for ep in listen]
    listen = [ep.replace("tcp://[::]:", "tcp://[::1]:") for ep in listen]
    return config, listen, folder


def can_read_kv_events() -> bool:
    """Whether pyzmq and msgpack are here, for a prefix router to learn from the replicas' KV events
    (logged when they are not)."""
    try:
        # lazy: optional dependency (pyzmq, msgpack)
        import msgpack  # noqa: F401
        import zmq  # noqa: F401
    except ImportError:
        logger.info("the prefix router goes by where it sent prefixes; with pyzmq and msgpack "
                    "(pip install 'conveyor[kv-events]') it learns what each replica's cache holds")
        return False
    return True


class KVEventListener:
    """Subscribes to each replica's KV events (vLLM's wire format, conveyor/kv/events.py) and hands
    every batch to `feed(replica, events, lost)`, `lost` when its sequence number skipped some."""

    def __init__(self, endpoints: list[str], topic: str, feed: Callable[[int, list, bool], None]):
        import zmq   # lazy: optional dependency (pyzmq)

        self._ctx = zmq.Context()
        self._socks = []
        for ep in endpoints:
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
            if ep.startswith("tcp://[") or "::" in ep:
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(ep)
            self._socks.append(sock)
        self._feed = feed
        self.batches = 0   # batches handed to feed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="conveyor-kv-events-router", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # lazy: optional dependency (pyzmq, msgpack)
        import msgpack
        import zmq

        poller = zmq.Poller()
        for sock in self._socks:
            poller.register(sock, zmq.POLLIN)
        expect: list[int | None] = [None] * len(self._socks)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(100):
                    i = self._socks.index(sock)
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        try:   # [topic, seq (8 bytes, big-endian), msgpack([ts, events(, dp_rank)])]
                            _, seq_bytes, payload = frames
                            seq = int.from_bytes(seq_bytes, "big", signed=True)
                            lost = expect[i] is not None and seq != expect[i]
                            expect[i] = seq + 1
                            events = msgpack.unpackb(payload)[1]   # (dp_rank may be left out, as vLLM's struct allows)
                            self._feed(i, events, lost)
                        except Exception:   # noqa: BLE001 - a bad batch must not stop the listener
                            logger.exception("a KV-event batch of replica %d could not be read", i)
                        self.batches += 1
        finally:
            for sock in self._socks:
                sock.close(linger=0)
            self._ctx.term()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
