"""KV cache events in vLLM 0.32's wire format, read as a consumer built on vLLM reads them: a
frozen copy of vLLM 0.32's msgspec schema (below) decodes every batch a real engine publishes over
ZMQ, live or replayed, and encoding the decoded batch again gives back the very bytes Conveyor sent
(key order, defaults left out, integer widths). Where vLLM is installed, its own ``KVEventBatch``
decodes them too.

A subscriber watches a real engine (a tiny cache, so blocks are evicted) and rebuilds the cache
from the events: every stored block's tokens and parent chain must be the tokens of a request
(prompt + output, block by block), removals must name blocks stored before, the final state must
be the engine's prefix cache, sequence numbers consecutive; a late subscriber gets what it missed
from the replay socket; the cache salt rides in extra_keys; swapped blocks move to medium CPU.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")
msgspec = pytest.importorskip("msgspec")

from conveyor.bench.serve import free_port  # noqa: E402
from conveyor.kv.events import KVEventRecorder  # noqa: E402
from conveyor.lora.request import LoRARequest  # noqa: E402
from conveyor.routing import prefix_keys  # noqa: E402
from conveyor.sampling.params import SamplingParams  # noqa: E402

from engine_testlib import run_all  # noqa: E402

END = -1
TOPIC = b"kv@10.0.0.7@tiny"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


# ---- vLLM 0.32's schema (vllm/distributed/kv_events.py), frozen here -----------------------------
# The batch is an array; each event a map whose "type" key names its class; msgspec leaves out a
# field that is at its default. Field order is wire order.

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)

# The keys of each event's map, in order, as Conveyor fills them (vLLM's block pool sends the same).
WIRE_KEYS = {
    "BlockStored": ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys", "group_idx"],
    "BlockRemoved": ["type", "block_hashes", "medium", "group_idx"],
    "AllBlocksCleared": ["type"],
}


# ---- a subscriber -----------------------------------------------------------------------------

def subscribe(port: int):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(f"tcp://127.0.0.1:{port}")
    return sub


def receive_until(sub, last_seq: int) -> list[tuple[int, bytes]]:
    """Live messages (seq, payload) up to and including last_seq."""
    out = []
    while not out or out[-1][0] < last_seq:
        assert sub.poll(20_000), "no KV-event message within 20 s"
        topic, seq, payload = sub.recv_multipart()
        assert topic == TOPIC and len(seq) == 8
        out.append((int.from_bytes(seq, "big"), payload))
    return out


def replay(port: int, start: int) -> list[tuple[int, bytes]]:
    """Ask the replay socket for every batch from `start` on (a DEALER sends what REQ would):
    replies [b"", topic, seq, payload], then [b"", b"", -1, b""]."""
    req = zmq.Context.instance().socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(f"tcp://127.0.0.1:{port}")
    try:
        req.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert req.poll(20_000), "the replay socket did not answer within 20 s"
            empty, topic, seq, payload = req.recv_multipart()
            assert empty == b"" and len(seq) == 8
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == END:
                assert topic == b"" and payload == b""
                return out
            assert topic == TOPIC
            out.append((seq, payload))
    finally:
        req.close(0)


def decode(payload: bytes) -> KVEventBatch:
    """The batch through the frozen schema; it must encode back to the same bytes."""
    batch = DECODER.decode(payload)
    assert msgspec.msgpack.encode(batch) == payload, "not what vLLM 0.32's encoder writes for this batch"
    assert isinstance(batch.ts, float) and isinstance(batch.data_parallel_rank, int)
    return batch


def check_keys(payload: bytes) -> None:
    """Each event of the batch, read as plain msgpack: a map with exactly the expected keys, in order."""
    ts, events, dp_rank = msgpack.unpackb(payload, raw=False)
    for e in events:
        assert isinstance(e, dict) and list(e) == WIRE_KEYS[e["type"]], e


class CacheModel:
    """The engine's cache as the events describe it."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.live = {"GPU": set(), "CPU": set()}
        self.blocks: dict[int, tuple[int | None, list[int], tuple | None]] = {}   # hash -> (parent, tokens, extra)
        self.stored = self.removed = 0
        self.cleared = 0

    def apply(self, ev: KVCacheEvent) -> None:
        if isinstance(ev, BlockStored):
            hashes, bs = ev.block_hashes, self.block_size
            assert ev.block_size == bs and ev.lora_id is None and ev.lora_name is None and ev.group_idx == 0
            assert len(ev.token_ids) == len(hashes) * bs
            extra = ev.extra_keys or [None] * len(hashes)
            assert len(extra) == len(hashes)
            parent = ev.parent_block_hash
            for j, h in enumerate(hashes):
                assert isinstance(h, int) and 0 <= h < 1 << 64
                assert h not in self.live[ev.medium], "stored twice without a removal"
                if parent is not None:
                    assert parent in self.blocks, "a parent never stored"
                self.live[ev.medium].add(h)
                self.blocks.setdefault(h, (parent, ev.token_ids[j * bs:(j + 1) * bs], extra[j]))
                assert self.blocks[h][:2] == (parent, ev.token_ids[j * bs:(j + 1) * bs])
                parent = h
            self.stored += len(hashes)
        elif isinstance(ev, BlockRemoved):
            assert ev.group_idx == 0
            for h in ev.block_hashes:
                assert h in self.live[ev.medium], "removed a block that is not cached"
                self.live[ev.medium].remove(h)
            self.removed += len(ev.block_hashes) if ev.medium == "GPU" else 0
        else:
            assert isinstance(ev, AllBlocksCleared)
            self.live["GPU"].clear()
            self.live["CPU"].clear()
            self.cleared += 1

    def sequence(self, h: int) -> tuple[list[int], tuple | None]:
        """The tokens from the start of h's sequence through h, and its first block's extra keys."""
        chain = []
        while h is not None:
            chain.append(h)
            h = self.blocks[h][0]
        chain.reverse()
        return [t for c in chain for t in self.blocks[c][1]], self.blocks[chain[0]][2]


def engine_hashes(engine) -> set[int]:
    """The engine's cached keys in the documented int form (the sha256 key's last 8 bytes, big-endian)."""
    return {int.from_bytes(key[-8:], "big") for key in engine.kv.pool.cached}


def check_tokens(model: CacheModel, sequences: list[list[int]]) -> None:
    """Every block ever stored holds block-aligned tokens of some request, after its own prefix."""
    for h in model.blocks:
        tokens, _ = model.sequence(h)
        assert any(seq[:len(tokens)] == tokens for seq in sequences), "a stored block's tokens match no request"


def make_prompts(n: int, seed: int, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 256) for _ in range(shared)]
    return [prefix + [rng.randrange(1, 256) for _ in range(rng.randint(10, 40))] for _ in range(n)]


@pytest.fixture
def ports():
    return free_port(), free_port()


def events_engine(make_engine, ports, **options):
    pub, rep = ports
    return make_engine(kv_events_endpoint=f"tcp://*:{pub}", kv_events_replay_endpoint=f"tcp://*:{rep}",
                       kv_events_topic=TOPIC.decode(), **options)


# ---- the tests ----------------------------------------------------------------------------------

def test_events_follow_the_cache_and_replay_fills_the_gap(make_engine, ports):
    engine = events_engine(make_engine, ports, num_kv_blocks=16, block_size=8)
    early = subscribe(ports[0])
    try:
        # A round trip through the replay socket: the publisher's thread is up and serving.
        assert replay(ports[1], 0) == []
        sequences = []
        first = make_prompts(6, seed=1, shared=17)   # a shared prefix: hits, and blocks stored once
        for out in run_all(engine, first, GREEDY):
            sequences.append(out.prompt_token_ids + list(out.outputs[0].token_ids))
        late = subscribe(ports[0])
        second = make_prompts(6, seed=2)
        for out in run_all(engine, second, GREEDY):
            sequences.append(out.prompt_token_ids + list(out.outputs[0].token_ids))
        cached = engine_hashes(engine)
        stats = engine.kv.prefix_cache_stats
        # Then a cache reset with no request running: the last batch, one AllBlocksCleared.
        assert engine.kv.reset_prefix_cache()
        engine.step()
        assert engine.kv_events.wait_sent()

        everything = replay(ports[1], 0)
        seqs = [s for s, _ in everything]
        assert seqs == list(range(len(seqs))) and seqs, "replay from 0: every batch, numbered 0, 1, 2, ..."
        last = seqs[-1]
        live = receive_until(early, last)
        live_seqs = [s for s, _ in live]
        assert live_seqs == list(range(live_seqs[0], last + 1)), "live batches are consecutive"
        assert all(everything[s][1] == p for s, p in live), "live and replayed batches are the same bytes"
        late_live = receive_until(late, last)
        k = late_live[0][0]
        assert k > 0 and [s for s, _ in late_live] == list(range(k, last + 1))
        missed = replay(ports[1], 0)[:k]   # what the late subscriber asks for: exactly what it missed
        assert [s for s, _ in missed] == list(range(k)) and missed == everything[:k]
        assert replay(ports[1], k) == everything[k:]

        model = CacheModel(block_size=8)
        for _, payload in everything[:-1]:
            check_keys(payload)
            batch = decode(payload)
            assert batch.data_parallel_rank == 0 and batch.events
            for ev in batch.events:
                assert not isinstance(ev, BlockStored) or ev.medium == "GPU"
                model.apply(ev)
        check_tokens(model, sequences)
        assert model.live["GPU"] == cached, "the events rebuild the engine's prefix cache"
        assert stats.evictions > 0 and model.removed == stats.evictions + stats.mismatches
        assert stats.prefix_hits > 0   # the shared prefix was reused, not stored again
        check_keys(everything[-1][1])
        assert decode(everything[-1][1]).events == [AllBlocksCleared()]
        assert engine_hashes(engine) == set()
    finally:
        early.close(0)
        engine.close()


def test_cache_salt_is_in_the_first_blocks_extra_keys(make_engine, ports):
    engine = events_engine(make_engine, ports, num_kv_blocks=64, block_size=8)
    try:
        prompt = make_prompts(1, seed=3)[0] + list(range(1, 30))
        run_all(engine, [{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}], GREEDY)
        run_all(engine, [prompt], GREEDY)
        assert engine.kv_events.wait_sent()
        model = CacheModel(block_size=8)
        stored = []
        for _, payload in replay(ports[1], 0):
            check_keys(payload)
            for ev in decode(payload).events:
                model.apply(ev)
                stored += [ev] if isinstance(ev, BlockStored) else []
        salted = [ev for ev in stored if any(ev.extra_keys)]
        assert len(salted) == 1 and salted[0].parent_block_hash is None
        assert salted[0].extra_keys[0] == ("tenant-a",) and not any(salted[0].extra_keys[1:])
        assert all(ev.extra_keys == [None] * len(ev.block_hashes) for ev in stored if ev is not salted[0])
        # Every block of the salted sequence chains back to that first block; the unsalted run's
        # blocks (same tokens) have other hashes and no extra keys.
        chains = {}
        for h in model.live["GPU"]:
            tokens, extra = model.sequence(h)
            chains.setdefault(extra is not None, []).append(tokens)
        assert sorted(map(len, chains[True])) == sorted(map(len, chains[False]))
        assert model.live["GPU"] == engine_hashes(engine)
    finally:
        engine.close()


def test_a_loras_blocks_carry_its_id_and_name_as_vllm_sends_them():
    """A sequence under a LoRA adapter: every stored run carries lora_id and lora_name; its first
    block's extra keys are [lora name, salt] (vLLM 0.32's order); the hashes are the router's keys."""
    recorder, lora, tokens = KVEventRecorder(4), LoRARequest("sql", 3, "/adapters/sql"), list(range(1, 13))
    keys = prefix_keys(tokens, 4, 3, "salt-1", lora.cache_key)
    recorder.stored(keys[:2], None, tokens[:8], "salt-1", lora=lora, first=True)
    recorder.stored(keys[2:], keys[1], tokens[8:], None, lora=lora)
    recorder.stored(prefix_keys(tokens, 4, 1), None, tokens[:4], None, first=True)   # the base model's
    batch = msgspec.msgpack.encode([1.0, recorder.pending, 0])
    check_keys(batch)
    first, later, base = decode(batch).events
    assert (first.lora_id, first.lora_name, later.lora_id, later.lora_name) == (3, "sql", 3, "sql")
    assert first.extra_keys == [("sql", "salt-1"), None] and later.extra_keys == [None]
    assert later.parent_block_hash == first.block_hashes[-1]
    assert (base.lora_id, base.lora_name, base.extra_keys) == (None, None, [None])
    assert base.block_hashes[0] != first.block_hashes[0]   # the same tokens, another adapter: another block


def test_swap_moves_blocks_to_medium_cpu_and_back(make_engine, ports):
    # 24 blocks of 8 tokens cannot hold 10 requests of up to 150 tokens: swap preemption. After
    # every step, the events so far rebuild the engine's cache exactly.
    engine = events_engine(make_engine, ports, num_kv_blocks=24, block_size=8, preemption_mode="swap",
                           admission_policy="optimistic", min_resident_steps=1)
    try:
        rng = random.Random(1)
        prefix = [rng.randrange(1, 256) for _ in range(20)]
        prompts = [(prefix if i % 2 else []) + [rng.randrange(1, 256) for _ in range(rng.randint(3, 90))]
                   for i in range(10)]
        ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
               for p in prompts]
        model, on_host, next_seq, outs = CacheModel(block_size=8), 0, 0, {}
        while engine.has_unfinished_requests():
            outs.update((o.request_id, o) for o in engine.step() if o.finished)
            assert engine.kv_events.wait_sent()
            for seq, payload in replay(ports[1], next_seq):
                assert seq == next_seq
                next_seq += 1
                check_keys(payload)
                for ev in decode(payload).events:
                    if isinstance(ev, BlockStored) and ev.medium == "CPU":
                        on_host += len(ev.block_hashes)
                        assert all(h in model.blocks for h in ev.block_hashes), "cached on the device first"
                    model.apply(ev)
            assert model.live["GPU"] == engine_hashes(engine)
        assert engine.stats().num_swaps_out > 0
        assert on_host > 0 and model.live["CPU"] == set(), "every host copy is reported gone after swap-in"
        check_tokens(model, [outs[i].prompt_token_ids + list(outs[i].outputs[0].token_ids) for i in ids])
    finally:
        engine.close()


def test_vllms_own_decoder_reads_every_batch(make_engine, ports):
    """vLLM's KVEventBatch, where vLLM is installed: every batch of a run with evictions, a salted
    sequence and a cache reset decodes as it does with the frozen schema, and encodes back to the
    bytes sent."""
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    vllm_decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
    engine = events_engine(make_engine, ports, num_kv_blocks=16, block_size=8)
    try:
        prompts = make_prompts(4, seed=5, shared=17)
        run_all(engine, [{"prompt_token_ids": prompts[0], "cache_salt": "tenant-b"}] + prompts[1:], GREEDY)
        assert engine.kv.reset_prefix_cache()
        engine.step()
        assert engine.kv_events.wait_sent()
        kinds = set()
        for _, payload in replay(ports[1], 0):
            batch = vllm_decoder.decode(payload)
            assert msgspec.msgpack.encode(batch) == payload
            assert msgspec.to_builtins(batch) == msgspec.to_builtins(decode(payload))
            kinds.update(type(ev).__name__ for ev in batch.events)
        assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    finally:
        engine.close()


def test_off_by_default_and_no_work(make_engine):
    engine = make_engine()
    assert engine.kv_events is None and engine.kv.events is None and engine.kv.pool.on_remove is None
    run_all(engine, make_prompts(2, seed=4), GREEDY)
    assert engine.kv.host_keys == {}


def test_data_parallel_replicas_get_their_own_ports():
    from conveyor.kv.events import offset_endpoint

    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("tcp://indexer.svc:5557", 1) == "tcp://indexer.svc:5558"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert offset_endpoint(None, 3) is None


@pytest.mark.slow
def test_process_engine_replica_publishes_on_its_own_port(ports):
    """The demo model in an engine process, as data-parallel replica 1: its events leave the child
    on the base ports + 1, with dp_rank 1."""
    import asyncio

    from conveyor.config import EngineConfig
    from conveyor.transport.process import ProcessEngine

    base_pub, base_rep = ports[0] - 1, ports[1] - 1   # replica 1 binds base + 1: the free ports
    config = EngineConfig.from_options(dtype="float32", num_kv_blocks=64, cost_model="none", data_parallel_rank=1,
                                       kv_events_endpoint=f"tcp://*:{base_pub}",
                                       kv_events_replay_endpoint=f"tcp://*:{base_rep}", kv_events_topic=TOPIC.decode())
    engine = ProcessEngine(config)
    try:
        async def main():
            stream = engine.add_request("The quick brown fox jumps over the lazy dog. " * 4, GREEDY, "a")
            return [out async for out in stream][-1]

        out = asyncio.run(main())
        sequence = out.prompt_token_ids + list(out.outputs[0].token_ids)
        full = (len(sequence) - 1) // 16   # the last token's KV is never computed
        model, batches = CacheModel(block_size=16), []
        for _ in range(400):   # the child sends after its step: wait for every block (at most ~20 s)
            batches = replay(ports[1], 0)
            if sum(len(getattr(e, "block_hashes", ())) for _, p in batches for e in decode(p).events) >= full:
                break
            time.sleep(0.05)
        for _, payload in batches:
            batch = decode(payload)
            assert batch.data_parallel_rank == 1
            for ev in batch.events:
                model.apply(ev)
        assert len(model.live["GPU"]) == full > 0
        check_tokens(model, [sequence])
    finally:
        engine.close(timeout=5)
