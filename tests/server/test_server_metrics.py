"""/metrics parses as Prometheus text and its counters move exactly with a known workload."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

EXPECTED = ["conveyor:num_requests_running", "conveyor:num_requests_waiting", "conveyor:num_requests_swapped",
            "conveyor:kv_cache_usage_perc", "conveyor:prefix_cache_queries", "conveyor:prefix_cache_hits",
            "conveyor:num_preemptions", "conveyor:prompt_tokens", "conveyor:generation_tokens",
            "conveyor:request_success", "conveyor:time_to_first_token_seconds",
            "conveyor:inter_token_latency_seconds", "conveyor:e2e_request_latency_seconds",
            "conveyor:request_queue_time_seconds", "conveyor:request_queue_timeouts",
            "conveyor:kv_invariant_violations", "conveyor:prefix_cache_mismatches",
            "conveyor:preemption_blocks_swapped", "conveyor:preemption_tokens_recomputed",
            "conveyor:weight_bytes", "conveyor:kv_cache_bytes"]


def test_metrics_parse(server, model_name):
    r = server.http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in EXPECTED:
        assert name in families, name
        for s in families[name].samples:
            assert s.labels["model_name"] == model_name
    modes = {s.labels["mode"] for s in families["conveyor:num_preemptions"].samples}
    assert modes == {"swap", "recompute"}
    assert families["conveyor:time_to_first_token_seconds"].type == "histogram"
    for name in ("conveyor:request_queue_timeouts", "conveyor:kv_invariant_violations",
                 "conveyor:prefix_cache_mismatches", "conveyor:preemption_blocks_swapped",
                 "conveyor:preemption_tokens_recomputed"):
        assert families[name].type == "counter"


def test_resident_bytes(server):
    """The weights held (at least the GGUF's tensor bytes: blocks as stored, or dequantized) and
    the KV cache, which is exactly its blocks."""
    import gguf

    from conveyor.model.loader import demo_model_path

    families = {f.name: f for f in text_string_to_metric_families(server.http.get("/metrics").text)}
    (weights,) = families["conveyor:weight_bytes"].samples
    (kv,) = families["conveyor:kv_cache_bytes"].samples
    (info,) = families["vllm:cache_config_info"].samples
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(demo_model_path())).tensors)
    assert file_bytes * 0.99 <= weights.value <= file_bytes * 12   # fp32 plain + prepacked at most
    cfg = server.engine.engine.model_config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    dtype_bytes = kv.value / (int(info.labels["num_gpu_blocks"]) * int(info.labels["block_size"]) * per_token)
    assert dtype_bytes in (2, 4)


def test_counters_follow_workload(server, client, model_name):
    server.wait_idle()
    before = server.metrics()
    completion = client.completions.create(model=model_name, prompt=["One two three", "Red green"], max_tokens=5,
                                           temperature=0, extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0.5, seed=1, n=2)
    stop = client.completions.create(model=model_name, prompt="Counting: 1, 2, 3,", max_tokens=6, temperature=0,
                                      extra_body={"stop_token_ids": [28]})
    server.wait_idle()
    after = server.metrics()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    generated = completion.usage.completion_tokens + chat.usage.completion_tokens + stop.usage.completion_tokens
    assert completion.usage.completion_tokens == 10
    assert delta("conveyor:generation_tokens_total") == generated
    finishes = [c.finish_reason for r in (completion, chat, stop) for c in r.choices]
    for reason in ("stop", "length"):
        assert delta(f"conveyor:request_success_total{{finished_reason={reason}}}") == finishes.count(reason)
    assert delta("conveyor:e2e_request_latency_seconds_count") == len(finishes)
    assert delta("conveyor:time_to_first_token_seconds_count") == len(finishes)
    assert delta("conveyor:request_queue_time_seconds_count") == len(finishes)
    # One inter-token gap per token after the first, per sequence.
    assert delta("conveyor:inter_token_latency_seconds_count") == generated - len(finishes)
    # At most each sequence's prompt: n=2 siblings share full cached blocks, not a partial last block.
    assert 0 < delta("conveyor:prompt_tokens_total") <= (completion.usage.prompt_tokens + 2 * chat.usage.prompt_tokens
                                                         + stop.usage.prompt_tokens)
    assert after["conveyor:num_requests_running"] == 0 and after["conveyor:kv_cache_usage_perc"] == 0.0


def test_prefix_cache_counters(server, client, model_name):
    server.wait_idle()
    before = server.metrics()
    prompt = "A long shared system prompt that spans several KV blocks. " * 6
    for _ in range(2):
        client.completions.create(model=model_name, prompt=prompt, max_tokens=1, temperature=0)
    after = server.metrics()
    blocks = (len(server.http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]) - 1) // 16
    assert after["conveyor:prefix_cache_queries_total"] - before["conveyor:prefix_cache_queries_total"] == 2 * blocks
    assert after["conveyor:prefix_cache_hits_total"] - before["conveyor:prefix_cache_hits_total"] >= blocks
