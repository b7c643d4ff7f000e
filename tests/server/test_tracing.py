"""OpenTelemetry: one `llm_request` span per engine request, its phases, the caller's trace, preemptions."""

from __future__ import annotations

import asyncio
import json
import pickle
import time

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk.trace")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from conftest import start_server  # noqa: E402

from conveyor.core.engine_core import metrics_snapshot  # noqa: E402
from conveyor.request import Request  # noqa: E402
from conveyor.sampling.params import SamplingParams  # noqa: E402
from conveyor.server.tracing import make_tracer_provider  # noqa: E402

MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
SLACK_NS = 1_000_000_000   # the monotonic -> epoch shift is taken per span: a busy machine can preempt the
                           # thread between its two clock reads


@pytest.fixture(scope="module")
def traced(demo_model):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    handle = start_server(demo_model, tracer_provider=provider)
    yield handle, exporter
    handle.stop()


def _requests(exporter: InMemorySpanExporter, count: int, timeout: float = 30.0) -> list:
    """The `llm_request` spans, once there are `count` (they are written once the response has ended)."""
    deadline = time.monotonic() + timeout
    while True:
        spans = [s for s in exporter.get_finished_spans() if s.name == "llm_request"]
        if len(spans) >= count:
            time.sleep(0.1)
            spans = [s for s in exporter.get_finished_spans() if s.name == "llm_request"]
            assert len(spans) == count, spans
            return spans
        assert time.monotonic() < deadline, f"{len(spans)} llm_request spans, expected {count}"
        time.sleep(0.02)


def _children(exporter: InMemorySpanExporter, parent) -> dict:
    return {s.name: s for s in exporter.get_finished_spans()
            if s.parent is not None and s.parent.span_id == parent.context.span_id}


@pytest.mark.slow
def test_request_span(traced):
    server, exporter = traced
    exporter.clear()
    before = time.time_ns()
    r = server.openai().chat.completions.create(model=server.engine.model_name, messages=MESSAGES, max_tokens=5,
                                                temperature=0.7, top_p=0.9, seed=1)
    after = time.time_ns()
    [span] = _requests(exporter, 1)
    a = span.attributes
    assert a["gen_ai.request.id"] == r.id and a["gen_ai.response.model"] == r.model
    assert a["gen_ai.usage.prompt_tokens"] == r.usage.prompt_tokens
    assert a["gen_ai.usage.completion_tokens"] == r.usage.completion_tokens
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.n"]) == (5, 1)
    assert a["gen_ai.request.temperature"] == pytest.approx(0.7) and a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert list(a["gen_ai.response.finish_reasons"]) == [r.choices[0].finish_reason]
    assert 0 <= a["gen_ai.latency.time_in_queue"] <= a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert a["gen_ai.latency.time_in_model_prefill"] >= 0 and a["gen_ai.latency.time_in_model_decode"] >= 0
    assert span.parent is None   # no traceparent: a root span
    # Epoch times: inside the wall-clock window of the call.
    assert before - SLACK_NS <= span.start_time <= span.end_time <= after + SLACK_NS
    assert span.end_time - span.start_time == pytest.approx(a["gen_ai.latency.e2e"] * 1e9, abs=1e6)
    kids = _children(exporter, span)
    assert set(kids) == {"queue", "prefill", "decode"}
    queue, prefill, decode = kids["queue"], kids["prefill"], kids["decode"]
    assert all(k.context.trace_id == span.context.trace_id for k in kids.values())
    assert span.start_time == queue.start_time <= queue.end_time == prefill.start_time <= prefill.end_time \
        == decode.start_time <= decode.end_time <= span.end_time
    assert (queue.end_time - queue.start_time) == pytest.approx(a["gen_ai.latency.time_in_queue"] * 1e9, abs=1e3)
    assert not span.events   # not preempted


@pytest.mark.slow
def test_traceparent(traced):
    server, exporter = traced
    exporter.clear()
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    server.openai().completions.create(model=server.engine.model_name, prompt="Once upon a time", max_tokens=3,
                                       n=2, extra_headers={"traceparent": f"00-{trace_id}-{parent_id}-01"})
    [span] = _requests(exporter, 1)
    assert span.context.trace_id == int(trace_id, 16)
    assert span.parent is not None and span.parent.span_id == int(parent_id, 16) and span.parent.is_remote
    assert span.attributes["gen_ai.request.n"] == 2 and span.attributes["gen_ai.usage.num_sequences"] == 2
    assert span.attributes["gen_ai.usage.completion_tokens"] <= 6


@pytest.mark.slow
def test_several_prompts_one_span_each(traced):
    server, exporter = traced
    exporter.clear()
    r = server.openai().completions.create(model=server.engine.model_name, prompt=["One two", "Red green blue"],
                                           max_tokens=2)
    spans = _requests(exporter, 2)
    assert sorted(s.attributes["gen_ai.request.id"] for s in spans) == [f"{r.id}-0", f"{r.id}-1"]
    assert sum(s.attributes["gen_ai.usage.prompt_tokens"] for s in spans) == r.usage.prompt_tokens


@pytest.mark.slow
def test_aborted_request(traced):
    server, exporter = traced
    exporter.clear()
    body = {"prompt": "Tell me a story.", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            first = next(x for x in r.iter_lines() if x.startswith("data:"))
    [span] = _requests(exporter, 1)   # written once the engine has answered the abort
    assert span.attributes["gen_ai.request.id"] == json.loads(first[5:])["id"]
    assert list(span.attributes["gen_ai.response.finish_reasons"]) == ["abort"]
    assert 1 <= span.attributes["gen_ai.usage.completion_tokens"] < 2000
    kids = _children(exporter, span)
    assert kids["decode"].end_time <= span.end_time


@pytest.mark.slow
def test_preemption_events(demo_model):
    # 8 blocks of 16 tokens for 4 sequences admitted optimistically: 4 requests of ~70 tokens each cannot
    # all keep their KV, so some are preempted (recomputed). Rounds repeat until the engine reports one.
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    server = start_server(demo_model, num_kv_blocks=8, max_num_seqs=4, tracer_provider=provider,
                          engine_options=dict(admission_policy="optimistic", preemption_mode="recompute"))
    client = server.async_openai()

    async def burst() -> None:
        await asyncio.gather(*(client.completions.create(model=server.engine.model_name, prompt=f"Story {i}:",
                                                         max_tokens=64, temperature=0,
                                                         extra_body={"ignore_eos": True}) for i in range(4)))

    try:
        rounds = 0
        while server.engine.stats().num_preemptions == 0:
            assert rounds < 5, "no preemption after 5 rounds"
            asyncio.run(burst())
            rounds += 1
        spans = _requests(exporter, 4 * rounds)
        preempted = [s for s in spans if s.attributes["conveyor.num_preemptions"] > 0]
        assert preempted
        assert sum(s.attributes["conveyor.num_preemptions"] for s in spans) == server.engine.stats().num_preemptions
        for s in preempted:
            events = [e for e in s.events if e.name == "preemption"]
            assert len(events) == s.attributes["conveyor.num_preemptions"]
            times = [e.timestamp for e in events]
            assert times == sorted(times) and s.start_time <= times[0] and times[-1] <= s.end_time
            assert s.attributes["gen_ai.usage.completion_tokens"] == 64   # preemption loses no output
    finally:
        server.stop()


def test_preemption_times_survive_the_snapshot_and_the_pipe():
    req = Request("r", [1, 2, 3], SamplingParams())
    req.metrics.num_preemptions, req.metrics.preemption_times = 2, [10.5, 11.25]
    snap = metrics_snapshot(req)   # what the core sends the front end (pickled by the process engine)
    assert snap.preemption_times == [10.5, 11.25] and snap.preemption_times is not req.metrics.preemption_times
    assert pickle.loads(pickle.dumps(snap)).preemption_times == [10.5, 11.25]


def test_otlp_endpoint_needs_the_extra():
    try:
        import opentelemetry.exporter.otlp.proto.http  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match=r"conveyor\[otel\]"):
            make_tracer_provider("http://127.0.0.1:4318")
    else:
        make_tracer_provider("http://127.0.0.1:4318").shutdown()
