"""Conveyor's Serve request router (``conveyor.ray.serve.PrefixRouter``) driven through the hooks
Serve 2.60's router calls, in the order it calls them (ray/serve/_private/router.py): choose, send,
then for a replica at its strict ``max_ongoing_requests`` a rejection (new queue-length info, the
call cancelled, ``on_request_completed``); for an accepted one ``on_request_routed`` and, when it
finishes, ``on_request_completed``; the replica set it is handed (``update_replicas``), whose KV
events it subscribes to. No cluster: the router object alone.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID  # noqa: E402

from conveyor.frontend.inputs import ProcessedRequest  # noqa: E402
from conveyor.sampling.params import SamplingParams  # noqa: E402

DEPLOYMENT = DeploymentID(name="ConveyorEngine", app_name="conveyor")
PREFIX = list(range(1000, 1000 + 16 * 4))   # 4 full blocks of 16


def _router():
    from conveyor.ray.serve import PrefixRouter

    router = PrefixRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN,
                          use_replica_queue_len_cache=True)
    router.initialize_state(policy="prefix", block_size=16, balance_slack=8)
    return router


def _replicas():
    return [SimpleNamespace(replica_id=ReplicaID(unique_id=f"r{i}", deployment_id=DEPLOYMENT)) for i in range(2)]


def _pending(ids, rid):
    """A pending call of generate() as Serve's router holds it: the ProcessedRequest and the call's id."""
    return SimpleNamespace(args=[ProcessedRequest(None, ids, SamplingParams())],
                           metadata=SimpleNamespace(internal_request_id=rid))


def _choose(router, replicas, ids, rid="any"):
    ranked = asyncio.run(router.choose_replicas(replicas, _pending(ids, rid)))
    return ranked[0][0]


def _accepted(router, replica, rid):
    router.on_send_request(replica.replica_id)
    router.on_new_queue_len_info(replica.replica_id, 1)
    router.on_request_routed(_pending([], rid), replica.replica_id, None)
    return lambda: router.on_request_completed(replica.replica_id, rid)


def _rejected(router, replica, rid):
    router.on_send_request(replica.replica_id)
    router.on_new_queue_len_info(replica.replica_id, 4)   # at its limit: not accepted
    router.on_request_completed(replica.replica_id, rid)   # the cancelled call completes


def test_rejections_are_uncounted_and_prefix_routing_still_sticks():
    router, replicas = _router(), _replicas()
    home = _choose(router, replicas, PREFIX + [1, 2, 3], "a")
    _accepted(router, home, "a")()   # served and finished there: the prefix lives on `home`
    for i in range(20):              # far beyond balance_slack: Serve tried `home` and it said no
        assert _choose(router, replicas, PREFIX + [4, i], f"rejected-{i}") is home
        _rejected(router, home, f"rejected-{i}")
    # Every rejection was uncounted: `home` is idle again, so the shared prefix goes there
    # (had the 20 stayed counted, its load would exceed the other's by more than the slack).
    assert _choose(router, replicas, PREFIX + [5, 6], "b") is home


def test_accepted_requests_count_until_completed():
    router = _router()
    router.initialize_state(policy="least-load")
    replicas = _replicas()
    first = _choose(router, replicas, [1, 2, 3], "a")
    done = _accepted(router, first, "a")
    second = _choose(router, replicas, [4, 5, 6], "b")
    assert second is not first   # `first` carries one request
    done_second = _accepted(router, second, "b")
    done()
    assert _choose(router, replicas, [7, 8], "c") is first   # `first`'s request finished: it is the idler one
    done_second()


def test_every_path_counts_a_request_once_and_uncounts_it_once():
    """Serve 2.60's paths (ray/serve/_private/router.py, _route_and_send_request_once): accepted then
    completed (success, error and cancellation all complete through the result's done callback);
    cancelled while the replica's answer on acceptance was awaited; a replica chosen but the send
    raised (Serve completes the request in its `finally` without ever sending it); chosen and never
    sent at all; the replica's actor died."""
    import time

    router, (r0, _) = _router(), _replicas()
    rid0 = r0.replica_id
    assert _choose(router, [r0], [1], "running") is r0
    assert router.in_flight(rid0) == 1            # chosen: counted before the send
    done = _accepted(router, r0, "running")
    assert router.in_flight(rid0) == 1            # the same request, still once

    _choose(router, [r0], [2], "cancelled")
    router.on_send_request(rid0)
    assert router.in_flight(rid0) == 2
    router.on_request_completed(rid0, "cancelled")   # cancelled before the acceptance came back
    assert router.in_flight(rid0) == 1

    _choose(router, [r0], [3], "send-failed")
    assert router.in_flight(rid0) == 2
    router.on_request_completed(rid0, "send-failed")  # try_send_request raised: never sent
    assert router.in_flight(rid0) == 1               # the running request is still counted

    router.on_request_completed(rid0, "never-seen")  # a completion for a request never counted here
    assert router.in_flight(rid0) == 1

    _choose(router, [r0], [4], "abandoned")          # chosen, then the caller went away before a send
    assert router.in_flight(rid0) == 2
    router._load(rid0).chosen["abandoned"] -= 2.0    # as if chosen 2 s ago: the choice lapsed
    assert router.in_flight(rid0) == 1

    done()                                           # the running one ends (success, error or cancel)
    assert router.in_flight(rid0) == 0
    for _ in range(3):
        _accepted(router, r0, f"x{time.monotonic()}")
    router.on_replica_actor_died(rid0)               # its requests fail with it
    assert router.in_flight(rid0) == 0


def test_prefix_router_learns_from_a_replicas_kv_events(tmp_path):
    """A replica that publishes KV events (its endpoint in Serve's replica metadata) is subscribed to
    when Serve hands the router its replicas; blocks it stores draw the prompts that start with them,
    though the router never sent them there (Router.learn, as the built-in data-parallel router)."""
    pytest.importorskip("zmq")
    import time

    from conveyor.kv.events import KVEventRecorder, ZmqEventPublisher
    from conveyor.routing import prefix_keys

    endpoint = f"ipc://{tmp_path}/events"
    publisher = ZmqEventPublisher(endpoint)

    async def queue_len(**_):
        return 0

    replicas = [SimpleNamespace(replica_id=ReplicaID(unique_id=f"r{i}", deployment_id=DEPLOYMENT),
                                replica_metadata={"kv_events": {"endpoint": endpoint, "node_ip": None}} if i else {},
                                routing_stats={}, get_queue_len=queue_len, max_ongoing_requests=64)
                for i in range(2)]
    router = _router()

    async def scenario():
        router.update_replicas(replicas)   # r1 publishes: the router subscribes
        assert _live(router) == {"r0", "r1"}
        recorder = KVEventRecorder(16)
        recorder.stored(prefix_keys(PREFIX, 16, 4), None, PREFIX, None)
        events = recorder.take()
        deadline = time.monotonic() + 20
        while True:   # a subscriber joins a moment after it connects: publish until r1 is chosen
            publisher.publish(events)
            choice = await router.choose_replicas(replicas, _pending(PREFIX + [7], "p"))
            if choice[0][0] is replicas[1] or time.monotonic() > deadline:
                return choice[0][0]
            router._load(choice[0][0].replica_id).chosen.clear()
            await asyncio.sleep(0.05)

    try:
        assert asyncio.run(scenario()) is replicas[1]
        router.on_replica_actor_died(replicas[1].replica_id)
        assert _live(router) == {"r0"}   # the ingress's client flags it down (health, /metrics)
    finally:
        router._stop_listening("r1")
        publisher.close()


def _live(router):
    from conveyor.ray import serve as ray_serve

    return set(ray_serve._live_replicas[(DEPLOYMENT.app_name, DEPLOYMENT.name)])


def test_deployment_options_place_cpu_and_gpu_bundles_and_serve_accepts_them():
    """The placement bundles per replica for CPU and CUDA engines, with and without tensor
    parallelism, as Serve's own deployment decorator validates them (no cluster, no GPU needed:
    the options are data; whether a GPU node runs them is not checked here)."""
    from ray import serve

    from conveyor.config import EngineConfig
    from conveyor.ray.serve import get_deployment_options

    cases = [
        (dict(torch_threads=2), [{"CPU": 2.0}], "STRICT_PACK", {"num_cpus": 2.0}),
        (dict(device="cuda"), [{"GPU": 1.0, "CPU": 1.0}], "STRICT_PACK", {"num_cpus": 1.0, "num_gpus": 1.0}),
        (dict(device="cuda", tensor_parallel_size=2, distributed_executor_backend="ray", torch_threads=4),
         [{"GPU": 1.0, "CPU": 4.0}] * 2, "PACK", {"num_cpus": 4.0, "num_gpus": 1.0}),
        (dict(tensor_parallel_size=2), [{"CPU": 1.0}] * 2, "STRICT_PACK", {"num_cpus": 1.0}),
    ]
    for options, bundles, strategy, actor in cases:
        opts = get_deployment_options(EngineConfig.from_options(**options), num_replicas=2)
        assert opts["placement_group_bundles"] == bundles and opts["placement_group_strategy"] == strategy
        assert opts["ray_actor_options"] == actor and opts["num_replicas"] == 2
        dep = serve.deployment(**opts)(type("Engine", (), {}))   # Serve checks the actor fits bundle 0
        assert dep.num_replicas == 2
    auto = get_deployment_options(EngineConfig.from_options(), autoscaling_config={"min_replicas": 1,
                                                                                   "max_replicas": 3})
    assert "num_replicas" not in auto and auto["autoscaling_config"]["max_replicas"] == 3
    with pytest.raises(ValueError):   # an actor that does not fit its bundle is refused by Serve itself
        serve.deployment(**{**opts, "ray_actor_options": {"num_cpus": 8.0}})(type("Engine", (), {}))


def test_a_completion_without_a_request_id_takes_one_off():
    """Serve versions that report a completion without its request id (decrement_queue_len_cache):
    each completion takes exactly one request off, accepted ones first, never below zero."""
    from conveyor.ray.serve import ReplicaLoad

    load = ReplicaLoad()
    for rid in ("a", "b"):
        load.sent()
        load.routed(rid)
    load.sent()   # a third still being sent
    assert load.count(0.0) == 3
    for left in (2, 1, 0, 0):
        load.completed(None)
        assert load.count(0.0) == left
