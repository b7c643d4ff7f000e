"""Tensor-parallel ranks placed by Ray (``distributed_executor_backend="ray"``) on a local 2-node
Ray cluster (``ray.cluster_utils.Cluster``, one CPU each), so the two ranks of one engine must land on
different nodes: a Ray Serve replica with tensor_parallel_size 2 (rank 0 in its placement group's
bundle 0, rank 1 a Ray actor in bundle 1) answers the official openai client with a single
engine's greedy text; an ``LLM`` outside any placement group makes its own group, gives TP=1's
tokens and logprobs, and removes the group when closed.
"""

from __future__ import annotations


import openai
import pytest

ray = pytest.importorskip("ray")

from conveyor.bench.serve import free_port  # noqa: E402
from conveyor.config import EngineConfig  # noqa: E402
from conveyor.engine.llm import LLM  # noqa: E402
from conveyor.sampling.params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

OPTIONS = dict(dtype="float32", num_kv_blocks=128, max_num_seqs=8, cost_model="none", torch_threads=1)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def single():
    """TP=1, in this process: the answers to match (tensor parallelism runs the demo GGUF dequantized:
    so does this reference)."""
    with LLM(None, **OPTIONS, quantization="none") as llm:
        return llm.generate(PROMPTS, GREEDY, use_tqdm=False)


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    ray.init(address=c.address, log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def _groups() -> list[dict]:
    return list(ray.util.placement_group_table().values())


def test_serve_replica_with_ranks_on_two_nodes(cluster, single):
    from ray import serve

    from conveyor.ray.serve import build_application

    config = EngineConfig.from_options(**OPTIONS, tensor_parallel_size=2, distributed_executor_backend="ray")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_application(config, num_replicas=1, num_cpus=1), name="conveyor", route_prefix="/")
        live = [g for g in _groups() if g["state"] == "CREATED" and len(g["bundles"]) == 2]
        assert len(live) == 1, live   # the replica's group: rank 0's bundle and rank 1's
        assert live[0]["strategy"] == "PACK"
        assert len(set(live[0]["bundles_to_node_id"].values())) == 2   # one CPU per node: the ranks span both
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        for prompt, want in zip(PROMPTS, single, strict=True):
            r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.choices[0].text == want.outputs[0].text
        stream = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(ch.choices[0].text for ch in stream) == single[0].outputs[0].text
    finally:
        serve.shutdown()


def test_llm_outside_a_group_places_its_ranks_and_removes_its_group(cluster, single):
    before = {g["placement_group_id"] for g in _groups()}
    with LLM(None, **OPTIONS, tensor_parallel_size=2, distributed_executor_backend="ray") as llm:
        mine = [g for g in _groups() if g["placement_group_id"] not in before]
        assert len(mine) == 1 and mine[0]["state"] == "CREATED" and mine[0]["bundles"] == {0: {"CPU": 1.0}}
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for x, y in zip(outs, single, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
            assert lx.keys() == ly.keys() and max(abs(lx[k] - ly[k]) for k in lx) < 1e-3   # as the mp-launched TP tests
    state = {g["placement_group_id"]: g["state"] for g in _groups()}
    assert state[mine[0]["placement_group_id"]] == "REMOVED"
