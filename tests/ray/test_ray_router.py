"""Conveyor's Serve request router (``conveyor.ray.serve.PrefixRouter``) driven through the hooks
Serve 2.60's router calls, in the order it calls them (ray/serve/_private/router.py): choose, send,
then for a replica at its strict ``max_ongoing_requests`` a rejection (new queue-length info, the
call cancelled, ``on_request_completed``); for an accepted one ``on_request_routed`` and, when it
finishes, ``on_request_completed``. No cluster: the router object alone.
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


def _choose(router, replicas, ids):
    request = SimpleNamespace(args=[ProcessedRequest(None, ids, SamplingParams())])   # as generate() receives it
    ranked = asyncio.run(router.choose_replicas(replicas, request))
    return ranked[0][0]


def _accepted(router, replica, rid):
    router.on_send_request(replica.replica_id)
    router.on_new_queue_len_info(replica.replica_id, 1)
    router.on_request_routed(None, replica.replica_id, None)
    return lambda: router.on_request_completed(replica.replica_id, rid)


def _rejected(router, replica, rid):
    router.on_send_request(replica.replica_id)
    router.on_new_queue_len_info(replica.replica_id, 4)   # at its limit: not accepted
    router.on_request_completed(replica.replica_id, rid)   # the cancelled call completes


def test_rejections_are_uncounted_and_prefix_routing_still_sticks():
    router, replicas = _router(), _replicas()
    home = _choose(router, replicas, PREFIX + [1, 2, 3])
    _accepted(router, home, "a")()   # served and finished there: the prefix lives on `home`
    for i in range(20):              # far beyond balance_slack: Serve tried `home` and it said no
        assert _choose(router, replicas, PREFIX + [4, i]) is home
        _rejected(router, home, f"rejected-{i}")
    # Every rejection was uncounted: `home` is idle again, so the shared prefix goes there
    # (had the 20 stayed counted, its load would exceed the other's by more than the slack).
    assert _choose(router, replicas, PREFIX + [5, 6]) is home


def test_accepted_requests_count_until_completed():
    router = _router()
    router.initialize_state(policy="least-load")
    replicas = _replicas()
    first = _choose(router, replicas, [1, 2, 3])
    done = _accepted(router, first, "a")
    second = _choose(router, replicas, [4, 5, 6])
    assert second is not first   # `first` carries one request
    done_second = _accepted(router, second, "b")
    done()
    assert _choose(router, replicas, [7, 8]) is first   # `first`'s request finished: it is the idler one
    done_second()


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
