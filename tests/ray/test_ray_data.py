"""ray.data batch inference: the engine as an actor-pool map_batches stage gives, for 64 prompts,
exactly what ``conveyor.LLM.generate`` gives for the same prompts and seeds (greedy and seeded
sampling; text and token-id rows)."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from conveyor.engine.llm import LLM  # noqa: E402
from conveyor.ray.data import process  # noqa: E402
from conveyor.sampling.params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

ENGINE = {"dtype": "float32", "num_kv_blocks": 256, "max_num_seqs": 16, "cost_model": "none", "torch_threads": 1}
TOPICS = ["the sea", "a city at night", "an old clock", "rain", "a cat", "mountains", "bread", "a library"]
PROMPTS = [f"Write one sentence about {TOPICS[i % 8]} (#{i}):" for i in range(64)]


@pytest.fixture(scope="module")
def ray_local():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


def row_params(i: int) -> dict:
    """Even rows greedy, odd rows seeded nucleus sampling."""
    return {"temperature": 0.0} if i % 2 == 0 else {"temperature": 1.0, "top_p": 0.9, "seed": i}


def test_ray_data_matches_llm_generate_greedy_and_seeded(ray_local):
    with LLM(**ENGINE) as llm:
        expected = llm.generate(PROMPTS, [SamplingParams(max_tokens=6, **row_params(i)) for i in range(64)],
                                use_tqdm=False)
    # rows 2, 3 of every 4 come as token ids (as after ray.data.llm's chat-template + tokenize stages)
    rows = [{"id": i, "sampling_params": row_params(i),
             **({"prompt_token_ids": expected[i].prompt_token_ids} if i % 4 >= 2 else {"prompt": p})}
            for i, p in enumerate(PROMPTS)]
    out = process(ray.data.from_items(rows), ENGINE, sampling_params={"max_tokens": 6}, concurrency=2,
                  batch_size=16).take_all()
    by_id = {r["id"]: r for r in out}
    assert sorted(by_id) == list(range(64))
    for i in range(64):
        want = expected[i].outputs[0]
        assert list(by_id[i]["generated_token_ids"]) == want.token_ids, i
        assert by_id[i]["generated_text"] == want.text
        assert by_id[i]["finish_reason"] == want.finish_reason
        assert by_id[i]["num_input_tokens"] == len(expected[i].prompt_token_ids)
