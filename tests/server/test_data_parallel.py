"""Data parallelism: two engine replicas behind one server. Every request answered once with the
single engine's output; the prefix router keeps a shared prefix on one replica (its cache hits on
/metrics, per replica); a replica killed mid-run fails only its own requests and is reported down.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import uvicorn

from conveyor.config import EngineConfig
from conveyor.core.engine_core import EngineDeadError
from conveyor.transport.data_parallel import DataParallelEngine, Router
from conveyor.engine.engine import Engine
from conveyor.core.stats import EngineStats
from conveyor.routing import external_hash, prefix_keys
from conveyor.sampling.params import SamplingParams
from conveyor.server.app import build_app

from conftest import ServerHandle, free_port


def test_prefix_router_keeps_a_prefix_on_its_replica_unless_much_busier():
    r = Router("prefix", block_size=4, prefix_blocks=2, balance_slack=2)
    shared = list(range(8))
    first = r.choose(shared + [100], [0, 0])
    assert r.choose(shared + [200], [1, 0] if first == 0 else [0, 1]) == first   # busier by 1: stays
    assert r.choose(shared + [300], [5, 0] if first == 0 else [0, 5]) != first   # busier by 5: moves
    assert r.choose([1, 2], [3, 0]) == 1 and r.choose([1, 2], [0, 3]) == 0       # short prompt: least load
    assert r.choose(shared[:4] + [9, 9, 9, 9], [0, 0]) == r.choose(shared[:4] + [7, 7, 7, 7], [0, 0])


def test_round_robin_and_least_load_skip_dead_replicas():
    rr = Router("round-robin")
    assert [rr.choose([], [0, None, 0]) for _ in range(4)] == [0, 2, 0, 2]
    assert Router("least-load").choose([], [4, 1, None]) == 1
    with pytest.raises(EngineDeadError):
        Router("least-load").choose([], [None, None])
    with pytest.raises(ValueError):
        Router("random")


def test_stats_sum_over_replicas():
    a = EngineStats(num_running=2, kv_usage=0.5, prefix_cache_queries=10, prefix_cache_hits=5, engine_dead=False,
                    last_step_time=0.1, consecutive_step_failures=2, num_unfinished_requests=3)
    b = EngineStats(num_running=1, kv_usage=0.0, prefix_cache_queries=10, prefix_cache_hits=0, engine_dead=True,
                    last_step_time=0.3, consecutive_step_failures=1, num_unfinished_requests=1)
    s = EngineStats.combine([a, b])
    assert s == EngineStats(num_running=3, kv_usage=0.25, prefix_cache_queries=20, prefix_cache_hits=5,
                            engine_dead=False, last_step_time=0.3, consecutive_step_failures=2,
                            num_unfinished_requests=4)
    assert s.prefix_cache_hit_rate == 0.25 and s.as_dict()["prefix_cache_hit_rate"] == 0.25
    assert EngineStats.combine([b, b]).engine_dead
    # layer groups (sliding-window models): per-group hits add up group by group, windows stay
    g = EngineStats.combine([a.replace(kv_group_windows=(0, 512), prefix_cache_group_hits=(5, 7)),
                             b.replace(kv_group_windows=(0, 512), prefix_cache_group_hits=(1, 2))])
    assert g.kv_group_windows == (0, 512) and g.prefix_cache_group_hits == (6, 9)
    # speculative decoding: counters summed, accepted drafts position by position (a replica that has
    # not reported yet has no positions: the others' still count)
    spec = dict(spec_num_drafts=4, spec_num_draft_tokens=10, spec_num_accepted_tokens=6, spec_rejected_tokens=4)
    sp = EngineStats.combine([a.replace(**spec, spec_accepted_per_pos=(3, 2, 1)),
                              b.replace(**spec, spec_accepted_per_pos=(4, 1, 1)), EngineStats()])
    assert (sp.spec_num_drafts, sp.spec_num_draft_tokens, sp.spec_num_accepted_tokens,
            sp.spec_rejected_tokens) == (8, 20, 12, 8)
    assert sp.spec_accepted_per_pos == (7, 3, 2)
    assert EngineStats.combine([a, b]).spec_accepted_per_pos == ()   # off


CONFIG = EngineConfig.from_options(dtype="float32", num_kv_blocks=128, max_num_seqs=8, cost_model="none")
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def dp_server():
    engine = DataParallelEngine(CONFIG, 2, "prefix", balance_slack=64)
    app = build_app(engine, log_interval=0, shutdown_timeout=5)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.05)
    handle = ServerHandle(port, engine, server, thread)
    yield handle
    handle.stop()
    sockets = engine._event_dir   # the replicas' private KV-event sockets (the router subscribes to them)
    engine.close()
    assert sockets is None or not os.path.exists(sockets)   # removed with the engine


def offline_texts(demo_model, prompts: list[str]) -> list[str]:
    engine = Engine(CONFIG, loaded=demo_model)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    texts = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                texts[out.request_id] = out.outputs[0].text
    return [texts[i] for i in ids]


@pytest.mark.slow
def test_every_request_answered_once_with_the_single_engine_output(dp_server, demo_model):
    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(12)]
    client = dp_server.openai()
    with ThreadPoolExecutor(12) as pool:
        got = list(pool.map(lambda p: client.completions.create(
            model=dp_server.engine.model_name, prompt=p, max_tokens=12, temperature=0,
            extra_body={"ignore_eos": True}), prompts))
    assert [r.choices[0].text for r in got] == offline_texts(demo_model, prompts)
    assert len({r.id for r in got}) == len(prompts)
    dp_server.wait_idle()
    per = dp_server.metrics(by_replica=True)
    assert per["conveyor:generation_tokens_total{replica=0}"] > 0       # both replicas served
    assert per["conveyor:generation_tokens_total{replica=1}"] > 0
    assert dp_server.metrics()["conveyor:generation_tokens_total"] == 12 * 12   # each answered exactly once
    assert dp_server.http.get("/health").json()["status"] == "ok"


@pytest.mark.slow
def test_prefix_router_sends_a_shared_prefix_to_one_replica(dp_server):
    before = dp_server.metrics(by_replica=True)
    preamble = "You are a careful assistant who answers in one line. Here are the house rules. " * 4
    client = dp_server.openai()
    for q in ("Name a color.", "Name a fruit.", "Name a tree.", "Name a river.", "Name a bird."):
        client.completions.create(model=dp_server.engine.model_name, prompt=preamble + q, max_tokens=2)
    after = dp_server.metrics(by_replica=True)

    def delta(key: str) -> float:
        return after[key] - before.get(key, 0.0)

    hits = [delta(f"conveyor:prefix_cache_hits_total{{replica={i}}}") for i in (0, 1)]
    queries = [delta(f"conveyor:prefix_cache_queries_total{{replica={i}}}") for i in (0, 1)]
    assert min(queries) == 0                  # all five went to one replica...
    assert max(hits) >= 4 * 4                 # ...and four of them found the preamble's blocks cached
    assert sum(hits) / sum(queries) > 0.6


@pytest.mark.slow
def test_the_prefix_router_learns_from_the_replicas_kv_events(dp_server):
    """A prompt run on replica 1 without the router: only replica 1's KV events can tell the router
    it holds the prompt's blocks. The next prompt sharing them goes there, against the load."""
    engine = dp_server.engine
    assert engine.events is not None   # pyzmq + msgpack come with the test extra: the router subscribes
    assert os.path.isdir(engine._event_dir)   # to each replica's socket in a private directory
    ids = engine.tokenizer.encode("Only replica one has read this preamble about tide pools and kelp. " * 6)
    keys = [external_hash(k) for k in prefix_keys(ids, CONFIG.block_size, engine.router.prefix_blocks)]
    assert len(keys) == engine.router.prefix_blocks and engine.router.owner(ids) is None

    async def run(submit, request_id: str) -> int | None:
        stream = submit(request_id)
        owner = engine._owner.get(request_id)
        async for _ in stream:
            pass
        return owner

    asyncio.run(run(lambda rid: engine.replicas[1].add_request(ids + [11], GREEDY, rid), "direct-1"))
    deadline = time.monotonic() + 30
    while engine.router.index is None or engine.router.index.leading(1, keys) < len(keys):
        assert time.monotonic() < deadline, "replica 1's BlockStored events did not reach the router"
        time.sleep(0.05)
    assert engine.router.index.leading(0, keys) == 0 and engine.router.owner(ids) is None
    loads = engine.loads()
    assert loads[0] <= loads[1]   # by load the next request would go to replica 0
    hits_before = dp_server.metrics(by_replica=True).get("conveyor:prefix_cache_hits_total{replica=1}", 0)
    held_before = engine.router.held_routed
    routed = asyncio.run(run(lambda rid: engine.add_request({"prompt_token_ids": ids + [12]}, GREEDY, rid),
                             "routed-1"))
    assert routed == 1 and engine.router.held_routed == held_before + 1
    dp_server.wait_idle()
    hits = dp_server.metrics(by_replica=True)["conveyor:prefix_cache_hits_total{replica=1}"] - hits_before
    assert hits >= len(keys)   # and found the blocks there (the counter counts blocks)


def test_the_replicas_map_one_packed_copy_of_the_gguf_weights(dp_server):
    """Both replica processes hold the demo GGUF's quantized weights as a mapping of the same packed
    file (model/packed.py): one copy in the page cache for both, not one each."""
    files = []
    for replica in dp_server.engine.replicas:
        maps = open(f"/proc/{replica._proc.pid}/maps").read().splitlines()
        files.append({line.split()[5] for line in maps
                      if len(line.split()) >= 6 and "/packed/" in line and line.endswith(".safetensors")})
    assert len(files[0]) == 1 and files[0] == files[1]


@pytest.mark.slow
def test_a_killed_replica_fails_only_its_requests_and_is_reported_down(dp_server):
    engine: DataParallelEngine = dp_server.engine
    client = dp_server.openai()
    model = engine.model_name
    long = dict(model=model, max_tokens=150, temperature=0, extra_body={"ignore_eos": True})

    def run(prompt: str):
        try:
            return "ok", client.completions.create(prompt=prompt, **long).choices[0].finish_reason
        except Exception as e:   # noqa: BLE001
            return "error", str(e)

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(run, f"Story number {i}: once upon a time") for i in range(4)]
        deadline = time.monotonic() + 60
        while True:   # every request reached a replica and both replicas run (however slow the machine)
            stats = engine.replica_stats()
            if sum(s.num_running + s.num_waiting for s in stats) == 4 and min(s.num_running for s in stats) > 0:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
        held = stats[1].num_running + stats[1].num_waiting
        victim = engine.replicas[1]
        os.kill(victim._proc.pid, 9)
        results = [f.result(timeout=120) for f in futures]
    assert sorted(kind for kind, _ in results) == ["error"] * held + ["ok"] * (4 - held)
    assert all("engine process exited unexpectedly" in msg for kind, msg in results if kind == "error")
    health = dp_server.http.get("/health")
    assert health.status_code == 200 and health.json() == {
        "status": "degraded", "replicas": [{"replica": 0, "up": True}, {"replica": 1, "up": False}]}
    per = dp_server.metrics(by_replica=True)
    assert per["conveyor:replica_up{replica=0}"] == 1 and per["conveyor:replica_up{replica=1}"] == 0
    assert engine.replica_stats()[1].num_running > 0   # the dead replica's last stats still say busy...
    deadline = time.monotonic() + 30
    while engine.replica_stats()[0].num_running or engine.replica_stats()[0].num_waiting:   # the survivor idle
        assert time.monotonic() < deadline
        time.sleep(0.05)
    gauges = load_gauges(dp_server.http.get("/metrics").text)
    assert {name for name, _ in gauges} >= {"conveyor:num_requests_running", "vllm:num_requests_running",
                                             "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}
    assert not [key for key in gauges if key[1] == "1"]   # ...but /metrics has no load gauge for it (no 0 = idle)
    for name in {name for name, _ in gauges}:       # and the server's totals are the survivor's
        assert sum(v for (n, _), v in gauges.items() if n == name) == gauges[name, "0"], name
    per = dp_server.metrics(by_replica=True)   # counters keep the dead replica's totals
    assert per["conveyor:generation_tokens_total{replica=1}"] > 0
    assert per["vllm:generation_tokens_total{engine=1}"] == per["conveyor:generation_tokens_total{replica=1}"]
    for i in range(3):   # the survivor takes everything now
        r = client.completions.create(model=model, prompt=f"After the crash {i}", max_tokens=3)
        assert r.choices[0].finish_reason == "length"


def load_gauges(text: str) -> dict[tuple[str, str], float]:
    """Every per-replica load gauge on /metrics (conveyor: and vllm: names) as {(name, replica): value};
    the status gauges (replica_up, engine_dead), info gauges and the series' creation times are left out."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        if family.type != "gauge" or family.name.endswith(("_info", "_created", "replica_up", "engine_dead")):
            continue
        for sample in family.samples:
            replica = sample.labels.get("replica", sample.labels.get("engine"))
            if replica is not None:
                out[sample.name, replica] = sample.value
    return out


def test_each_replica_gets_its_rank_and_its_own_step_trace_file(tmp_path):
    from conveyor.transport.data_parallel import replica_config

    config = EngineConfig.from_options(step_trace=str(tmp_path / "trace.json"))
    ranks = [replica_config(config, r) for r in (0, 1)]
    assert [c.data_parallel_rank for c in ranks] == [0, 1]
    assert [c.step_trace for c in ranks] == [str(tmp_path / f"trace.replica{r}.json") for r in (0, 1)]
    alone = replica_config(config, 0, own_trace=False)   # one replica: the file the user named
    assert alone.step_trace == config.step_trace and alone.data_parallel_rank == 0
    assert replica_config(EngineConfig.from_options(), 1).step_trace is None
