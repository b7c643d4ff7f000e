"""vLLM's metric names on /metrics, beside Conveyor's: the series the Gateway API Inference Extension's
endpoint picker (llm-d), vLLM production-stack's router and KEDA recipes read, with vLLM's types and
labels, and values equal to the matching `conveyor:` series -- requests, not sequences, where vLLM's
gauges count requests (an n=2 request is one running request and two running sequences).
"""

from __future__ import annotations

import threading
import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import start_server

# What the routers and autoscalers read (names as exposed: counters with _total).
GIE_NAMES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
             "vllm:gpu_cache_usage_perc", "vllm:lora_requests_info", "vllm:cache_config_info")
PRODUCTION_STACK_NAMES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc",
                          "vllm:gpu_prefix_cache_hit_rate", "vllm:gpu_prefix_cache_hits_total",
                          "vllm:gpu_prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                          "vllm:prefix_cache_queries_total")
DASHBOARD_NAMES = ("vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:prompt_tokens_cached_total",
                   "vllm:generation_tokens_total",
                   "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
                   "vllm:inter_token_latency_seconds_bucket", "vllm:time_per_output_token_seconds_bucket",
                   "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_count")


def scrape(http) -> tuple[dict[str, float], dict[str, str], list]:
    """(samples as {name{labels}: value} with model_name and the replica/engine label dropped (one
    engine here), family types by name, every sample with its labels)."""
    values, types, samples = {}, {}, []
    for family in text_string_to_metric_families(http.get("/metrics").text):
        types[family.name] = family.type
        for s in family.samples:
            samples.append(s)
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k not in ("model_name", "replica", "engine"))
            values[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return values, types, samples


@pytest.fixture(scope="module")
def two_seq_server(demo_model):
    """At most two sequences run at once, so an n=2 request fills the batch and the next one waits."""
    handle = start_server(demo_model, num_kv_blocks=256, max_num_seqs=2)
    yield handle
    handle.stop()


@pytest.mark.slow
def test_vllm_gauges_count_requests_not_sequences(two_seq_server):
    srv = two_seq_server
    client = srv.openai()
    model = srv.engine.model_name
    long = dict(model=model, prompt="Count slowly:", max_tokens=1500, temperature=0.8, stream=True,
                extra_body={"ignore_eos": True})
    streams, started = [], threading.Event()

    def open_stream(n: int) -> None:
        stream = client.completions.create(n=n, **long)
        streams.append(stream)
        started.set()
        try:
            for _ in stream:   # read until the test thread closes it
                pass
        except openai.APIConnectionError:
            pass

    threads = [threading.Thread(target=open_stream, args=(2,), daemon=True)]
    threads[0].start()
    deadline = time.monotonic() + 60
    while srv.engine.stats().num_running < 2:   # the n=2 request runs (two sequences)...
        assert time.monotonic() < deadline
        time.sleep(0.02)
    threads.append(threading.Thread(target=open_stream, args=(1,), daemon=True))
    threads[1].start()
    while srv.engine.stats().num_waiting < 1:   # ...and an n=1 request waits for a slot
        assert time.monotonic() < deadline
        time.sleep(0.02)
    values, types, _ = scrape(srv.http)
    for stream in streams:
        stream.response.close()   # disconnects abort both requests
    for t in threads:
        t.join(timeout=60)

    assert values["conveyor:num_requests_running"] == 2 and values["vllm:num_requests_running"] == 1
    assert values["conveyor:num_requests_waiting"] == 1 and values["vllm:num_requests_waiting"] == 1
    assert types["vllm:num_requests_running"] == types["vllm:num_requests_waiting"] == "gauge"
    assert 0 < values["vllm:kv_cache_usage_perc"] == values["conveyor:kv_cache_usage_perc"] <= 1
    assert values["vllm:gpu_cache_usage_perc"] == values["vllm:kv_cache_usage_perc"]
    srv.wait_idle()
    values, _, _ = scrape(srv.http)
    assert values["vllm:num_requests_running"] == values["vllm:num_requests_waiting"] == 0


@pytest.mark.slow
def test_every_vllm_name_is_served_with_the_conveyor_value(server):
    client = server.openai()
    model = server.engine.model_name
    before, _, _ = scrape(server.http)
    preamble = "The rules of the house, which every answer follows without exception, are these. " * 4
    r = client.completions.create(model=model, prompt=preamble + "One.", n=2, max_tokens=4, temperature=0.7,
                                  extra_body={"ignore_eos": True})
    assert len(r.choices) == 2
    two = client.completions.create(model=model, prompt=preamble + "Two.", max_tokens=3,   # a prefix-cache hit
                                    extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=3, extra_body={"ignore_eos": True})
    server.wait_idle()
    values, types, samples = scrape(server.http)

    for name in GIE_NAMES + PRODUCTION_STACK_NAMES + DASHBOARD_NAMES:
        assert any(s.name == name for s in samples), name
    assert not any(s.name.startswith("vllm:spec_decode_") for s in samples)   # speculation off: none, as vLLM
    for s in samples:   # vLLM's labels: the served model's name and the engine index
        if s.name.startswith("vllm:") and s.name not in ("vllm:lora_requests_info", "vllm:cache_config_info"):
            assert s.labels["model_name"] == model and s.labels["engine"] == "0", s

    def delta(key: str) -> float:
        return values[key] - before.get(key, 0.0)

    # vLLM's semantics: every sequence's prompt whole (n = 2 counts it twice), cache hits included;
    # Conveyor's own counter: the tokens computed (the second sequence and the hits are not)
    prompts = 2 * r.usage.prompt_tokens + two.usage.prompt_tokens + chat.usage.prompt_tokens
    assert delta("vllm:prompt_tokens_total") == prompts > delta("conveyor:prompt_tokens_total") > 0
    assert 16 <= delta("vllm:prompt_tokens_cached_total") < prompts
    assert delta("vllm:generation_tokens_total") == delta("conveyor:generation_tokens_total") == 2 * 4 + 3 + 3
    hits = values["conveyor:prefix_cache_hits_total"]
    queries = values["conveyor:prefix_cache_queries_total"]
    assert delta("conveyor:prefix_cache_hits_total") >= 4   # the second prompt found the preamble's blocks
    assert values["vllm:prefix_cache_hits_total"] == values["vllm:gpu_prefix_cache_hits_total"] == 16 * hits
    assert values["vllm:prefix_cache_queries_total"] == values["vllm:gpu_prefix_cache_queries_total"] == 16 * queries
    assert values["vllm:gpu_prefix_cache_hit_rate"] == pytest.approx(hits / queries)
    assert values["vllm:num_preemptions_total"] == (values["conveyor:num_preemptions_total{mode=swap}"]
                                                     + values["conveyor:num_preemptions_total{mode=recompute}"])
    assert values["vllm:kv_cache_usage_perc"] == values["conveyor:kv_cache_usage_perc"] == 0   # idle
    for reason in ("length", "stop"):
        key = f"request_success_total{{finished_reason={reason}}}"
        assert values.get(f"vllm:{key}", 0) == values.get(f"conveyor:{key}", 0)
    assert delta("vllm:request_success_total{finished_reason=length}") == 4   # per sequence, as vLLM's children
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "inter_token_latency_seconds"):
        assert values[f"vllm:{hist}_count"] == values[f"conveyor:{hist}_count"] > 0, hist
        assert values[f"vllm:{hist}_sum"] == pytest.approx(values[f"conveyor:{hist}_sum"]), hist
        assert types[f"vllm:{hist}"] == "histogram"
    assert values["vllm:time_per_output_token_seconds_count"] == values["vllm:inter_token_latency_seconds_count"]
    for counter in ("prompt_tokens", "generation_tokens", "num_preemptions", "prefix_cache_hits",
                    "prefix_cache_queries", "request_success"):
        assert types[f"vllm:{counter}"] == "counter", counter

    info = [s for s in samples if s.name == "vllm:cache_config_info"]
    assert len(info) == 1 and info[0].value == 1
    assert info[0].labels["block_size"] == "16" and info[0].labels["num_gpu_blocks"] == "256"
    assert info[0].labels["engine"] == "0"
    lora = [s for s in samples if s.name == "vllm:lora_requests_info"]
    assert len(lora) == 1 and lora[0].value > 0 and lora[0].labels == {
        "max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}


SPEC_NAMES = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
              "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos")


@pytest.fixture(scope="module")
def spec_server(demo_model):
    """Prompt-lookup speculation, every match drafted (not the cost model's choice)."""
    handle = start_server(demo_model, engine_options={"speculative_config": {
        "method": "ngram", "num_speculative_tokens": 4, "adaptive": False}})
    yield handle
    handle.stop()


@pytest.mark.slow
def test_spec_decode_counters_under_vllm_names(spec_server):
    """vLLM's SpecDecodingProm series: counters with (model_name, engine), the per-position one with
    `position` 0..num_speculative_tokens-1, there (at 0) before the first draft; values equal the
    engine's stats, and accepted drafts thin out with the position."""
    srv = spec_server
    values, types, samples = scrape(srv.http)
    assert [values[f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{position={p}}}"] for p in range(4)] == [0] * 4
    assert values["vllm:spec_decode_num_drafts_total"] == 0
    client = srv.openai()
    r = client.completions.create(model=srv.engine.model_name, prompt="a b c d e f g a b c d e f g a b c d e f g a b c",
                                  max_tokens=32, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 32
    stats = srv.wait_idle()
    values, types, samples = scrape(srv.http)

    for name in SPEC_NAMES:
        assert types[name] == "counter", name
    for s in samples:
        if s.name.startswith("vllm:spec_decode_"):
            assert s.labels["model_name"] == srv.engine.model_name and s.labels["engine"] == "0", s
            assert set(s.labels) == ({"model_name", "engine", "position"} if "per_pos" in s.name
                                     else {"model_name", "engine"}), s
    drafts = values["vllm:spec_decode_num_drafts_total"]
    draft_tokens = values["vllm:spec_decode_num_draft_tokens_total"]
    accepted = values["vllm:spec_decode_num_accepted_tokens_total"]
    per_pos = [values[f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{position={p}}}"] for p in range(4)]
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total{position=4}" not in values
    assert drafts > 0 and draft_tokens >= drafts and 0 <= accepted <= draft_tokens
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])) and sum(per_pos) == accepted
    assert per_pos[0] <= drafts
    assert (drafts, draft_tokens, accepted, tuple(per_pos)) == (
        stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens, stats.spec_accepted_per_pos)
    assert stats.spec_rejected_tokens == draft_tokens - accepted
