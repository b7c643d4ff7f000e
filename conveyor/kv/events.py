"""KV cache events in vLLM's wire format, for prefix-aware routers outside the engine.

llm-d's kv-cache indexer, Dynamo's KV router and Ray's KV-aware router learn which engine holds
which prompt prefixes from a stream of cache events; vLLM defined the stream and they all read
it. The KV manager reports to a ``KVEventRecorder`` (only when events are on: otherwise the
manager holds None and does no work at all); once per engine step the engine hands the step's
events to a ``ZmqEventPublisher``, whose thread sends them as one batch.

Wire format: vLLM 0.32's msgspec encoding of ``KVEventBatch`` (docs/scale-out.md, "KV events").
ZMQ PUB frames ``[topic, seq, payload]``, ``seq`` an 8-byte big-endian counter from 0 (one per
batch: a gap means batches were lost), ``payload`` the msgpack array ``[ts, events, dp_rank]``
(``EventBatch`` is array-like; the rank is always an int, as vLLM's publisher fills it in). Each
event is a msgpack map: ``"type"`` (the event's class name) first, then its fields in declaration
order; an optional field at its default (None) is left out, as msgspec's ``omit_defaults`` does:

- ``BlockStored``: ``block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name`` (always present, maybe nil), then ``extra_keys`` (one entry per block: nil, or
  ``[salt]`` on a salted sequence's first block) and ``group_idx`` (0: Conveyor reports its first
  KV cache group), as vLLM's block pool sends them;
- ``BlockRemoved``: ``block_hashes, medium, group_idx``;
- ``AllBlocksCleared``: no field.

Block hashes are Conveyor's own prefix-cache keys (sha256 chained over the parent key and the
block's content, conveyor/kv/prefix_cache.py) as unsigned 64-bit ints: the key's last 8 bytes,
big-endian (what vLLM sends by default). A ROUTER socket replays the last ``buffer_steps``
batches to a client that sends ``[b"", start_seq]`` (what a REQ socket sends), answering
``[b"", topic, seq, payload]`` per batch from ``start_seq`` on and ``[b"", b"", -1, b""]`` at the
end (the ROUTER adds the client's identity frame in front of each).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence

from conveyor.lora.request import LoRARequest
from conveyor.routing import external_hash   # a key as the events carry it (the router reads them back)

logger = logging.getLogger(__name__)

MEDIUM_DEVICE = "GPU"   # the engine's KV cache (vLLM's name for it, also on a CPU-only engine)
MEDIUM_HOST = "CPU"     # host memory holding a swapped-out request's blocks
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventRecorder:
    """One engine step's events, in their wire form (dicts, keys in vLLM's field order), until the
    engine takes them."""

    __slots__ = ("block_size", "pending", "_host")

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.pending: list[dict] = []
        self._host: Counter[int] = Counter()   # hash -> swapped-out copies in host memory

    def stored(self, keys: Sequence[bytes], parent: bytes | None, token_ids: list[int], salt: str | None,
               medium: str = MEDIUM_DEVICE, lora: LoRARequest | None = None, first: bool = False) -> None:
        """Consecutive full blocks of one sequence became reusable; `parent`: the key before the
        first of them (None: they start the sequence); `salt`: the sequence's cache salt, given
        only when the first block is the sequence's first (`first`); `lora`: its adapter. As vLLM
        0.32 reports them: the adapter's id and name, and the first block's extra keys [lora name,
        salt] (each only when set)."""
        hashes = [external_hash(k) for k in keys]
        if medium == MEDIUM_HOST:
            self._host.update(hashes)
        extra_keys: list = [None] * len(hashes)
        head = ([lora.lora_name] if lora is not None and first else []) + ([salt] if salt is not None else [])
        if head:
            extra_keys[0] = head
        self.pending.append({
            "type": "BlockStored", "block_hashes": hashes,
            "parent_block_hash": None if parent is None else external_hash(parent),
            "token_ids": token_ids, "block_size": self.block_size,
            "lora_id": None if lora is None else lora.lora_int_id, "medium": medium,
            "lora_name": None if lora is None else lora.lora_name, "extra_keys": extra_keys, "group_idx": 0})

    def removed(self, keys: Sequence[bytes], medium: str = MEDIUM_DEVICE) -> None:
        hashes = [external_hash(k) for k in keys]
        if medium == MEDIUM_HOST:   # a hash leaves the host only when its last copy there does
            gone = []
            for h in hashes:
                self._host[h] -= 1
                if self._host[h] <= 0:
                    del self._host[h]
                    gone.append(h)
            hashes = gone
        if not hashes:
            return
        last = self.pending[-1] if self.pending else None
        if last is not None and last["type"] == "BlockRemoved" and last["medium"] == medium:
            last["block_hashes"].extend(hashes)   # one event for a step's run of evictions
        else:
            self.pending.append({"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": 0})

    @property
    def host_blocks(self) -> int:
        return len(self._host)

    def cleared(self) -> None:
        self.pending.append({"type": "AllBlocksCleared"})

    def take(self) -> list[dict]:
        events, self.pending = self.pending, []
        return events


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """Replica `rank`'s endpoint: a tcp port + rank, an ipc/inproc name + "_dp{rank}" (as vLLM does)."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"a tcp KV-events endpoint needs a port, got {endpoint!r}")
        return f"{base}:{int(port) + rank}"
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}"
    raise ValueError(f"a KV-events endpoint must be tcp://, ipc:// or inproc://, got {endpoint!r}")


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard or local address (tcp://*:5557, ipc://, inproc://), connect to
    anything else (tcp://indexer:5557: a central subscriber that binds)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Sends event batches from a thread: a PUB socket (bounded by `hwm`; a subscriber too slow
    loses batches, and sees the gap in ``seq``) and an optional ROUTER replay socket serving the
    last `buffer_steps` batches. ``publish`` never blocks the engine: when `max_queue` batches are
    waiting for the thread, the new one is dropped (its seq is skipped, so the loss shows)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000, max_queue: int = 100_000, dp_rank: int = 0):
        try:
            # lazy: optional dependency (pyzmq, msgpack)
            import msgpack
            import zmq
        except ImportError as e:
            raise ImportError("KV events need pyzmq and msgpack: pip install 'conveyor[kv-events]'") from e

        if buffer_steps < 1 or hwm < 1 or max_queue < 1:
            raise ValueError("kv_events_buffer_steps and kv_events_hwm must be >= 1")
        self._zmq, self._pack = zmq, msgpack.Packer()
        self.endpoint = offset_endpoint(endpoint, dp_rank)
        self.replay_endpoint = offset_endpoint(replay_endpoint, dp_rank)
        self.dp_rank = dp_rank
        self._topic = topic.encode("utf-8")
        self._hwm = hwm
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue[tuple[int, float, list] | None] = queue.Queue(maxsize=max_queue)
        self._next_seq = 0
        self.dropped = 0
        # publish() wakes the thread through a pipe it polls beside the replay socket: no idle wake-ups.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        self._closed = self._error is not None
        if self._error is not None:
            self._close_pipe()
            raise RuntimeError(f"cannot open the KV-events sockets ({self.endpoint}, "
                               f"replay {self.replay_endpoint}): {self._error}") from self._error

    def publish(self, events: list[dict]) -> None:
        """Queue one step's events as a batch (nothing for an empty step)."""
        if not events or self._closed:
            return
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        try:
            self._queue.put_nowait((seq, time.time(), events))
            self._wake()
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("KV events: %d batch(es) dropped, the publisher thread cannot keep up", self.dropped)

    def wait_sent(self, timeout: float = 10.0) -> bool:
        """Block until every queued batch has been sent (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.005)
        return not self._queue.unfinished_tasks

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (for up to `timeout` seconds), then close the sockets."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self.wait_sent(timeout)
            self._queue.put(None)
            self._wake()
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_pipe()

    def _close_pipe(self) -> None:
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:   # the pipe is full: the thread has wake-ups pending anyway
            pass

    # ---- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        zmq = self._zmq
        ctx = zmq.Context.instance()
        pub = replay = None
        try:
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self._hwm)
            pub.setsockopt(zmq.LINGER, 0)
            (pub.bind if binds(self.endpoint) else pub.connect)(self.endpoint)
            if self.replay_endpoint:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self.replay_endpoint)
        except BaseException as e:   # noqa: BLE001 - reported to the constructor
            self._error = e
            for s in (pub, replay):
                if s is not None:
                    s.close(0)
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if replay is not None and replay in ready:
                    while replay.poll(0):
                        self._serve_replay(replay)
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                while True:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        self._queue.task_done()
                        return
                    self._send(pub, item)
        finally:
            pub.close(0)
            if replay is not None:
                replay.close(0)

    def _send(self, pub, item: tuple[int, float, list]) -> None:
        zmq = self._zmq
        try:
            seq, ts, events = item
            payload = self._pack.pack([ts, events, self.dp_rank])
            try:
                pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            except zmq.Again:   # at the high-water mark: this subscriber loses the batch
                pass
            self._buffer.append((seq, payload))
        except Exception:   # noqa: BLE001 - one bad batch must not stop the stream
            logger.exception("KV events: could not send a batch")
        finally:
            self._queue.task_done()

    def _serve_replay(self, replay) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: a malformed replay request (%d frames) was ignored", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", b"", END_SEQ, b""))
