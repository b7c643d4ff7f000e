"""Conveyor on Ray Serve: a local 2-node Ray cluster (``ray.cluster_utils.Cluster``, one CPU each)
serving the demo model with 2 engine replicas behind Serve's HTTP proxy. The official openai
client (streaming and not) gets Conveyor's own server's greedy answers; requests sharing a long
prefix land on one replica (its prefix-cache hits on /metrics); a killed replica fails only its own
in-flight requests and Serve replaces it.
"""

from __future__ import annotations

import importlib.util
import os
import random
import socket
import sys
import threading
import time

import httpx
import openai
import pytest

ray = pytest.importorskip("ray")

from conveyor.bench.serve import free_port  # noqa: E402
from conveyor.config import EngineConfig  # noqa: E402

pytestmark = pytest.mark.slow

CONFIG = EngineConfig.from_options(dtype="float32", num_kv_blocks=128, max_num_seqs=8, cost_model="none",
                                   torch_threads=1)


def _server_conftest():
    """tests/server/conftest.py's start_server (Conveyor's own server in a thread), loaded by path."""
    path = os.path.join(os.path.dirname(__file__), "..", "server", "conftest.py")
    spec = importlib.util.spec_from_file_location("conveyor_server_conftest", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod   # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def local_server():
    import torch

    from conveyor.model.loader import load_model

    conf = _server_conftest()
    handle = conf.start_server(load_model(None, "cpu", torch.float32))
    yield handle
    handle.stop()


def _free_ports(n: int) -> int:
    """A base port with base..base+n-1 all free (KV events: each replica binds the configured port + its rank).

    Drawn below the kernel's ephemeral range and above Ray's worker ports (10002-19999): the Ray
    processes started after this bind ephemeral ports (each Serve replica its own gRPC server), and
    one of them took a port free_port() had handed out here, so that a replica could never bind its
    KV-event socket and Serve restarted it forever (seen with Ray 2.60)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    rng = random.Random()
    for _ in range(1000):
        base = rng.randrange(20000, max(20001, ephemeral - n))
        try:
            for k in range(n):
                with socket.socket() as s:
                    s.bind(("0.0.0.0", base + k))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports below {ephemeral}")


KV_EVENTS = {}   # "base": publishers bound at base + 0, + 1 (replica ranks 0, 1); replay sockets at + 2, + 3
DEPLOY = {"seconds": 0.0}   # how long the fixture's deployment took to come up


@pytest.fixture(scope="module")
def ray_serve():
    from dataclasses import replace

    from ray import serve
    from ray.cluster_utils import Cluster

    from conveyor.ray.serve import build_application

    base = KV_EVENTS["base"] = _free_ports(4)
    config = replace(CONFIG, kv_events_endpoint=f"tcp://*:{base}", kv_events_replay_endpoint=f"tcp://*:{base + 2}")

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        t0 = time.monotonic()
        serve.run(build_application(config, num_replicas=2, num_cpus=1), name="conveyor", route_prefix="/")
        DEPLOY["seconds"] = time.monotonic() - t0   # how long replicas take to come up on this machine now
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _per_replica(url: str, name: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == name:
                out[s.labels["replica"]] = s.value
    return out


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
MESSAGES = [{"role": "user", "content": "Name three colors."}]


def test_openai_client_gets_the_single_servers_greedy_answers(ray_serve, local_server):
    ray_client, own = _client(ray_serve), local_server.openai()
    model = ray_client.models.list().data[0].id
    assert model == own.models.list().data[0].id
    for prompt in PROMPTS:
        a = ray_client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
        b = own.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
        assert a.choices[0].text == b.choices[0].text and a.usage == b.usage
    a = ray_client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
    b = own.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    chunks = ray_client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0,
                                                stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == b.choices[0].message.content
    chunks = ray_client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0, stream=True)
    expected = own.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0).choices[0].text
    assert "".join(ch.choices[0].text for ch in chunks) == expected


def test_shared_prefix_lands_on_one_replica(ray_serve):
    client = _client(ray_serve)
    model = client.models.list().data[0].id
    preamble = "You are a careful assistant. Answer briefly and precisely. " * 8   # > 4 KV blocks of 16
    before = _per_replica(ray_serve, "conveyor:prefix_cache_hits_total")
    for q in ("What is 2+2?", "Name a fruit.", "Say hi.", "What color is the sky?", "Count to three."):
        client.completions.create(model=model, prompt=preamble + q, max_tokens=2, temperature=0)
    after = _per_replica(ray_serve, "conveyor:prefix_cache_hits_total")
    gained = {r: after[r] - before.get(r, 0.0) for r in after}
    assert sorted(gained.values())[-1] >= 4 * 4, gained   # the 4 later requests hit >= 4 blocks each
    assert sum(v > 0 for v in gained.values()) == 1, gained   # all on one replica


def _replayed(port: int) -> list[tuple[int, list]]:
    """Every KV-event batch a replica still holds, from its replay socket: (dp_rank, events); the
    wire format read with plain zmq + msgpack (docs/scale-out.md, "Wire format")."""
    import msgpack
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(20_000), f"the replay socket on {port} did not answer"
            _, _topic, seq, payload = sock.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return out
            _ts, events, dp_rank = msgpack.unpackb(payload, raw=False)
            out.append((dp_rank, events))
    finally:
        sock.close(0)


def test_each_replica_publishes_kv_events_as_its_own_dp_rank(ray_serve):
    base = KV_EVENTS["base"]
    for port in (base, base + 1):   # each replica bound its publisher at the configured port + its rank
        with socket.socket() as s, pytest.raises(OSError):
            s.bind(("0.0.0.0", port))
    client = _client(ray_serve)
    model = client.models.list().data[0].id
    prompts = [f"Kv events under Ray, run {k}: " + " ".join(f"item{i}" for i in range(40)) for k in range(2)]
    ids = [httpx.post(f"{ray_serve}/tokenize", json={"model": model, "prompt": p}, timeout=30).json()["tokens"]
           for p in prompts]
    full = min(len(i) for i in ids) // 16
    assert full >= 2
    # two fresh prompts at once: routed by load, one to each replica
    client.completions.create(model=model, prompt=prompts, max_tokens=2, temperature=0)
    deadline = time.monotonic() + 60
    while True:   # the step that stored the blocks publishes them as it ends: poll the replay sockets
        found, ranks = {}, {}
        for rank in (0, 1):
            batches = _replayed(base + 2 + rank)
            ranks[rank] = {r for r, _ in batches}
            stored = {tuple(e["token_ids"][j:j + 16]) for _, events in batches for e in events
                      if e["type"] == "BlockStored"
                      for j in range(0, len(e["token_ids"]), 16)}   # an event may carry several blocks
            found[rank] = [all(tuple(i[16 * b:16 * (b + 1)]) in stored for b in range(full)) for i in ids]
        if all(any(f) for f in found.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert ranks == {0: {0}, 1: {1}}, ranks   # every batch on port + r carries dp_rank r, and both published
    # each prompt's blocks were stored by exactly one replica, a different one for each prompt
    assert sorted(found.values()) == [[False, True], [True, False]], found


def test_killed_replica_fails_only_its_requests_and_serve_replaces_it(ray_serve, local_server):
    from ray import serve

    client = _client(ray_serve)
    model = client.models.list().data[0].id
    prompts = [f"Story {i}:" for i in range(4)]   # under one block: routed by load, 2 per replica
    want = local_server.openai().completions.create(model=model, prompt=prompts, max_tokens=96, temperature=0,
                                                    extra_body={"ignore_eos": True})
    expected = {prompts[c.index]: c.text for c in want.choices}
    started = threading.Barrier(len(prompts) + 1, timeout=120)
    results: dict[str, str | Exception] = {}

    def run(p: str) -> None:
        text, first = "", True
        try:
            for ch in client.completions.create(model=model, prompt=p, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True}, max_tokens=96):
                text += ch.choices[0].text if ch.choices else ""
                if first and text:
                    first = False
                    started.wait()
            results[p] = text
        except Exception as e:   # noqa: BLE001 - the killed replica's requests
            results[p] = e
        finally:
            if first:
                started.abort()

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    started.wait()   # every stream has its first tokens: all four are running on their replicas
    running = _per_replica(ray_serve, "conveyor:num_requests_running")
    assert sorted(running.values())[-2:] == [2, 2], running   # two on each replica
    victim = next(name for name in ray.util.list_named_actors(all_namespaces=True)
                  if isinstance(name, dict) and "ConveyorEngine" in name["name"])
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    for t in threads:
        t.join(timeout=120)
    failed = [p for p, r in results.items() if isinstance(r, Exception)]
    assert len(failed) == 2, results
    for p, r in results.items():
        if p in failed:
            assert "engine replica failed" in str(r), r
        else:
            assert r == expected[p]

    # Serve starts a replacement: poll until 2 replicas run again, for as long as the first deployment
    # took and more (a replica loads the model: 230 s with two CPU-bound processes beside the suite)
    deadline = time.monotonic() + max(180.0, 3 * DEPLOY["seconds"])
    while True:
        dep = serve.status().applications["conveyor"].deployments["ConveyorEngine"]
        names = {n["name"] for n in ray.util.list_named_actors(all_namespaces=True) if "ConveyorEngine" in n["name"]}
        if (victim["name"] not in names and len(names) == 2 and dep.status == "HEALTHY"
                and dep.replica_states.get("RUNNING", 0) == 2):
            break
        assert time.monotonic() < deadline, f"{dep.status} {dep.replica_states} {dep.message} {names}"
        time.sleep(0.5)
    r = client.completions.create(model=model, prompt=prompts, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    for c in r.choices:   # both replicas serve again (the replacement with an empty cache)
        assert expected[prompts[c.index]].startswith(c.text)
