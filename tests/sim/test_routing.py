"""One router policy (conveyor/routing.py) for the data-parallel server and the simulator.

The server's Router and the simulator's route the same prompts under the same loads to the same
replicas, measuring load alike; cache salts keep prefixes apart; a down replica is never chosen;
in the simulator, prefix routing over two replicas raises the prefix-cache hit rate of a
shared-prefix workload above round-robin's. No model: the data-parallel engine's replicas are
stand-ins that report stats, the simulator's are the real scheduler and KV cache.
"""

from __future__ import annotations

import copy
import json
import threading

import pytest

from conveyor.cli import main
from conveyor.core.engine_core import EngineDeadError
from conveyor.transport.data_parallel import DataParallelEngine
from conveyor.frontend.inputs import InputProcessor, ProcessedRequest
from conveyor.transport.data_parallel import Router as ServerRouter
from conveyor.core.stats import EngineStats
from conveyor.kv.manager import block_content, chain_hash, extra_keys
from conveyor.request import Request
from conveyor.routing import NoReplicaError, Router, external_hash, policy_name, prefix_keys, replica_load
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler.config import SchedulerConfig
from conveyor.scheduler.costs import StepCostModel
from conveyor.sim.harness import drive, replica_loads
from conveyor.sim.simulator import make_replica, simulate
from conveyor.sim.workload import WorkloadSpec

PREFIXED = WorkloadSpec(num_requests=240, rate=6.0, prompt_len="160:260", output_len="8:40", prefix_groups=12,
                        prefix_len=128, seed=7)
CFG = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512)


def test_prefix_keys_are_the_kv_caches_block_keys():
    ids = list(range(1000, 1000 + 50))
    for salt in (None, "tenant-a", "ünï"):
        req = Request("r", ids, SamplingParams(), cache_salt=salt)
        parent, want = None, []
        for i in range(3):   # 50 tokens: three full blocks of 16
            parent = chain_hash(parent, block_content(ids[i * 16:(i + 1) * 16], extra_keys(req) if i == 0 else b""))
            want.append(parent)
        assert prefix_keys(ids, 16, 8, salt) == want
        assert prefix_keys(ids, 16, 2, salt) == want[:2]
    assert prefix_keys(ids[:15], 16, 4) == []
    assert prefix_keys(ids, 16, 4, "a") != prefix_keys(ids, 16, 4, "b") != prefix_keys(ids, 16, 4)


def test_policy_names():
    assert [policy_name(p) for p in ("prefix", "least-load", "least-loaded", "round-robin")] == \
        ["prefix", "least-load", "least-load", "round-robin"]
    with pytest.raises(ValueError):
        Router("random")
    with pytest.raises(NoReplicaError):
        Router("prefix").choose([1] * 64, [None, None])
    with pytest.raises(EngineDeadError):   # the server's Router keeps its engine's error
        ServerRouter("prefix").choose([1] * 64, [None, None])


class Recording(Router):
    """The simulator's router, recording each decision: (token ids, loads, salt) -> replica, and in
    `log` the decisions and the KV events it learned from, in order."""

    def __init__(self, *args, replicas=None, **kw):
        super().__init__(*args, **kw)
        self.calls: list[tuple[list[int], list[float | None], str | None, int]] = []
        self.log: list[tuple] = []
        self.replicas = replicas
        self.load_checks = 0

    def choose(self, token_ids, loads, cache_salt=None, adapter=None):
        if self.replicas is not None:   # the loads are the data-parallel engine's measure of these replicas
            assert list(loads) == server_loads(self.replicas)
            self.load_checks += 1
        assert adapter is None   # (these workloads have no LoRA adapters: the replay passes none)
        choice = super().choose(token_ids, loads, cache_salt, adapter)
        self.calls.append((list(token_ids), list(loads), cache_salt, choice))
        self.log.append(("choose", *self.calls[-1]))
        return choice

    def learn(self, replica, events):
        self.log.append(("learn", replica, copy.deepcopy(events)))
        super().learn(replica, events)


def replay(log: list[tuple], router: Router) -> list[int]:
    """The recorded decisions and events through another router: its choices."""
    got = []
    for entry in log:
        if entry[0] == "learn":
            router.learn(entry[1], entry[2])
        else:
            got.append(router.choose(entry[1], entry[2], entry[3]))
    return got


class SimReplicaClient:
    """A simulated replica as the data-parallel engine sees a ProcessEngine: health and stats
    (unfinished requests: the ones the client has added and not seen finish)."""

    def __init__(self, core, healthy: bool = True):
        self.core, self.is_healthy, self.dead_reason = core, healthy, None

    def stats(self) -> EngineStats:
        return self.core.engine_stats().replace(num_unfinished_requests=len(self.core.scheduler.requests))


def stub_engine(replicas, router: ServerRouter | None = None) -> DataParallelEngine:
    """A DataParallelEngine over stand-in replicas (its routing and load code, no processes)."""
    engine = object.__new__(DataParallelEngine)
    engine.replicas, engine.router = replicas, router or ServerRouter("prefix", 16)
    engine._lock, engine._owner, engine._reported_down = threading.Lock(), {}, set()
    engine.inputs = InputProcessor(None, 1000, 4096, [0])   # token-id prompts: no tokenizer needed
    return engine


def server_loads(sim_replicas) -> list[float | None]:
    return stub_engine([SimReplicaClient(r.core) for r in sim_replicas]).loads()


def test_the_server_and_the_simulator_route_the_same_prompts_to_the_same_replicas():
    reps = [make_replica(CFG, 200, 16, 0, StepCostModel(), True, False) for _ in range(2)]
    rec = Recording("prefix", 16, balance_slack=2, replicas=reps)
    records = drive(reps, PREFIXED.generate(), router=rec)
    assert rec.load_checks == len(records) and [c[3] for c in rec.calls] == \
        [r.replica for r in sorted(records, key=lambda r: r.arrival)]
    loads = [c[1] for c in rec.calls]
    assert any(a != b for a, b in loads) and any(a % 1 for a, _ in loads)   # loads varied, KV usage in them
    # the simulated replicas' KV events reached the router, as the server's replicas' do
    learned = [e for entry in rec.log if entry[0] == "learn" for e in entry[2]]
    assert {e["type"] for e in learned} >= {"BlockStored", "BlockRemoved"}
    server = ServerRouter("prefix", 16, balance_slack=2)
    assert replay(rec.log, server) == [c[3] for c in rec.calls]
    assert 0 < server.prefix_routed == rec.prefix_routed < len(records)
    assert 0 < server.held_routed == rec.held_routed <= rec.prefix_routed
    # least-load and round-robin alike
    for policy in ("least-load", "round-robin"):
        reps = [make_replica(CFG, 200, 16, 0, StepCostModel(), True, False) for _ in range(2)]
        rec = Recording(policy, 16)
        drive(reps, PREFIXED.generate(), router=rec)
        server = ServerRouter(policy, 16)
        assert [server.choose(ids, ld, salt) for ids, ld, salt, _ in rec.calls] == [c[3] for c in rec.calls]


class StubReplica:
    """Stands in for a ProcessEngine: counts its unfinished requests, records what it was sent."""

    def __init__(self, healthy: bool = True):
        self.is_healthy, self.dead_reason, self.got = healthy, None, []

    def stats(self) -> EngineStats:
        return EngineStats(num_unfinished_requests=len(self.got), kv_usage=0.0)

    def add_request(self, prompt, params, request_id, priority=0):
        assert isinstance(prompt, ProcessedRequest) and params is None   # processed once, by the DP engine
        self.got.append(request_id)
        return object()

    def add_finished_listener(self, listener) -> None:
        pass


def test_cache_salt_keeps_prefixes_apart():
    shared = list(range(100, 164))   # four blocks of 16
    r = Router("prefix", 16, balance_slack=2)
    first = r.choose(shared + [1], [0, 0], "a")
    other = 1 - first
    busier = [1, 0] if first == 0 else [0, 1]   # the prefix's replica busier by 1: within the slack
    assert r.choose(shared + [2], busier, "a") == first        # same salt: follows its prefix
    assert r.choose(shared + [3], busier, "b") == other        # another salt: by load, not by "a"'s prefix
    assert r.choose(shared + [4], busier) == other             # no salt is a salt of its own
    assert r.owner(shared, "b") == other and r.owner(shared, "a") == first

    # through the data-parallel engine: the dict prompt's cache_salt reaches the router
    reps = [StubReplica(), StubReplica()]
    engine = stub_engine(reps, ServerRouter("prefix", 16, balance_slack=8))
    params = SamplingParams()
    engine.add_request({"prompt_token_ids": shared + [1], "cache_salt": "a"}, params, "a1")
    engine.add_request({"prompt_token_ids": shared + [2], "cache_salt": "a"}, params, "a2")
    engine.add_request({"prompt_token_ids": shared + [3], "cache_salt": "b"}, params, "b1")
    engine.add_request({"prompt_token_ids": shared + [4], "cache_salt": "b"}, params, "b2")
    where = {rid: i for i, rep in enumerate(reps) for rid in rep.got}
    assert where["a1"] == where["a2"] and where["b1"] == where["b2"] and where["a1"] != where["b1"]


def stored(hashes, tokens, parent=None, medium="GPU"):
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
            "token_ids": list(tokens), "block_size": 16, "lora_id": None, "medium": medium, "lora_name": None}


def test_the_prefix_router_learns_what_each_replica_holds_from_its_kv_events():
    shared = list(range(100, 164))   # four blocks of 16
    keys = [external_hash(k) for k in prefix_keys(shared, 16, 4)]
    r = Router("prefix", 16, balance_slack=2)
    # replica 1 stored the prefix (a request sent to it some other way): the cache wins over the load
    r.learn(1, [stored(keys[:2], shared[:32]), stored(keys[2:], shared[32:], keys[1])])
    assert r.choose(shared + [1], [0, 1]) == 1 and r.held_routed == r.prefix_routed == 1
    assert r.choose(shared + [1], [0, 3]) == 0   # ... within the balance slack only
    # evicted past the first block: held 1 vs sent 4
    r.learn(1, [{"type": "BlockRemoved", "block_hashes": keys[1:], "medium": "GPU"}])
    assert r.choose(shared + [2], [0, 1]) == 0       # where the 4-block prefix was last sent (just above)
    r.learn(0, [stored(keys, shared)])
    r.learn(1, [stored(keys, shared)])
    assert r.choose(shared + [3], [0.5, 0]) == 1     # both hold it: the less loaded
    r.learn(1, [{"type": "AllBlocksCleared"}])
    assert r.choose(shared + [4], [0.5, 0]) == 0     # held by 0 only: held wins over sent at equal length
    assert r.index.blocks(1) == 0 and r.index.blocks(0) == 4
    # the longest held run wins; a longer prefix sent since (not stored yet) wins over a shorter held one
    r = Router("prefix", 16, balance_slack=2)
    r.learn(0, [stored(keys[:2], shared[:32])])
    r.learn(1, [stored(keys[:3], shared[:48])])
    assert r.choose(shared, [0, 1]) == 1
    r = Router("prefix", 16, balance_slack=2)
    assert r.choose(shared, [1, 0]) == 1              # nothing known: by load; the prefix was sent to 1
    r.learn(0, [stored(keys[:1], shared[:16])])
    assert r.choose(shared + [4], [0, 1]) == 1 and r.held_routed == 0
    # a swapped-out request's blocks in host memory are not a prefix a new request can hit
    r = Router("prefix", 16)
    r.learn(1, [stored(keys, shared, medium="CPU")])
    assert r.choose(shared, [0, 0.5]) == 0 and r.prefix_routed == 0
    # stored after a clear in the same batch: held
    r.learn(1, [{"type": "AllBlocksCleared"}, stored(keys, shared)])
    assert r.index.leading(1, keys) == 4


def test_a_down_replica_is_skipped():
    shared = list(range(100, 164))
    for policy in ("prefix", "least-load", "round-robin"):
        r = Router(policy, 16)
        assert {r.choose(shared, [0, None, 5]) for _ in range(6)} <= {0, 2}
        assert r.choose(shared, [None, None, 0]) == 2
    r = Router("prefix", 16)
    owner = r.choose(shared, [0, 0, 0])
    loads = [0, 0, 0]
    loads[owner] = None   # the prefix's replica went down: the least loaded live one, and the prefix moves
    moved = r.choose(shared, loads)
    assert moved != owner and r.owner(shared) == moved

    reps = [StubReplica(healthy=False), StubReplica(), StubReplica(healthy=False)]
    engine = stub_engine(reps)
    assert engine.loads() == [None, replica_load(0, 0.0), None]
    for i in range(3):
        engine.add_request({"prompt_token_ids": shared + [i]}, SamplingParams(), f"r{i}")
    assert reps[1].got == ["r0", "r1", "r2"] and not reps[0].got and not reps[2].got
    reps[1].is_healthy = False
    with pytest.raises(EngineDeadError):
        engine.add_request({"prompt_token_ids": shared}, SamplingParams(), "r9")


def test_prefix_routing_raises_the_prefix_cache_hit_rate_in_the_simulator():
    """Twelve groups sharing 128-token prefixes over two replicas whose caches hold only part of
    them: prefix routing keeps each group on one replica, round-robin makes both cache every group."""
    runs = {p: simulate(PREFIXED.generate(), CFG, num_blocks=120, replicas=2, router=p, prefix_caching=True)
            for p in ("prefix", "round-robin", "least-loaded")}
    hit = {p: res.stats.prefix_cache_hit_rate for p, res in runs.items()}
    assert hit["prefix"] > hit["round-robin"] + 0.1 and hit["prefix"] > hit["least-loaded"] + 0.1
    for res in runs.values():
        assert len(res.finished) == PREFIXED.num_requests and {r.replica for r in res.records} == {0, 1}
    # where it could, the prefix router kept each group on one replica
    workload = PREFIXED.generate()
    groups: dict[int, list[int]] = {}
    for spec, r in zip(workload, runs["prefix"].records):
        groups.setdefault(spec.prefix_group, []).append(r.replica)
    on_majority = sum(max(g.count(0), g.count(1)) for g in groups.values())
    assert on_majority > 0.8 * PREFIXED.num_requests


def test_simulate_command_routes_by_prefix(tmp_path, capsys):
    out = {}
    for router in ("prefix", "round-robin", "least-loaded"):
        path = tmp_path / f"{router}.json"
        assert main(["simulate", "--replicas", "2", "--router", router, "--num-requests", "120", "--rate", "6",
                     "--prompt-len", "160:260", "--output-len", "8:40", "--prefix-groups", "12", "--prefix-len",
                     "128", "--num-kv-blocks", "120", "--seed", "7", "--out", str(path)]) == 0
        out[router] = json.loads(path.read_text())["runs"][0]["summary"]["prefix_cache_hit_rate"]
    assert "prefix hit" in capsys.readouterr().out
    assert out["prefix"] > out["round-robin"]
