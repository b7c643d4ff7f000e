"""A Serve deployment that can never start fails fast and says why (``conveyor.ray.serve.deploy``):
engine replicas asking for more CPUs than the cluster has are never placed, and Serve alone would
wait for them forever."""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray")

from conveyor.config import EngineConfig  # noqa: E402

pytestmark = pytest.mark.slow


def test_replicas_that_cannot_be_placed_fail_the_deployment_naming_them():
    from ray import serve

    from conveyor.bench.serve import free_port
    from conveyor.ray.serve import DeployError, build_application, deploy

    config = EngineConfig.from_options(dtype="float32", num_kv_blocks=64, cost_model="none", torch_threads=1)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
        t0 = time.monotonic()
        with pytest.raises(DeployError) as e:
            deploy(build_application(config, num_cpus=64), name="never", timeout_s=10)
        took = time.monotonic() - t0
        message = str(e.value)
        assert "did not start within 10 s" in message, message
        # the engine replica by name, what it needs and what the cluster has
        assert "replica never#ConveyorEngine#" in message and "cannot be placed (INFEASIBLE)" in message, message
        assert "{'CPU': 64.0}" in message and "'CPU': 1.0" in message, message
        assert took < 60, took
        assert "never" not in serve.status().applications   # removed, not left retrying
    finally:
        serve.shutdown()
        ray.shutdown()
