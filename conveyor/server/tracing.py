"""OpenTelemetry tracing: one ``llm_request`` span per engine request, vLLM's attribute names.

The span is made when the request finishes, from its RequestMetrics (the engine's clock,
time.monotonic, shifted to epoch nanoseconds): it starts at the request's arrival and ends at its
finish, a child of the caller's span when the HTTP request carried a W3C ``traceparent``. Its
children ``queue``, ``prefill`` and ``decode`` cover the request's phases; each preemption is an
event at its time. No prompt or output text is recorded. OpenTelemetry is an optional extra
(``conveyor[otel]``): it is imported only when tracing is on.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlsplit

from conveyor.frontend.outputs import RequestOutput
from conveyor.request import RequestMetrics
from conveyor.sampling.params import SamplingParams

SPAN_NAME = "llm_request"


def _otel(what: str):
    try:
        from opentelemetry import propagate, trace   # lazy: optional dependency (opentelemetry)
    except ImportError as e:
        raise RuntimeError(f"{what} needs OpenTelemetry, which is not installed: "
                           "pip install 'conveyor[otel]'") from e
    return trace, propagate


def make_tracer_provider(endpoint: str, service_name: str = "conveyor") -> Any:
    """A TracerProvider exporting over OTLP/HTTP to `endpoint` (a bare http://host:4318 gets /v1/traces);
    OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES are honoured."""
    try:
        # lazy: optional dependency (opentelemetry)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise RuntimeError("--otlp-traces-endpoint needs the OpenTelemetry SDK and its OTLP/HTTP exporter "
                           "(opentelemetry-exporter-otlp-proto-http): pip install 'conveyor[otel]'") from e

    if urlsplit(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


class RequestTracer:
    """Writes finished engine requests as spans with `tracer_provider`'s tracer."""

    def __init__(self, tracer_provider: Any):
        self._trace, self._propagate = _otel("tracing")
        from opentelemetry.trace import SpanKind, Status, StatusCode   # lazy: optional dependency (opentelemetry)

        self._kind, self._status, self._error = SpanKind.SERVER, Status, StatusCode.ERROR
        self.tracer = tracer_provider.get_tracer("conveyor")

    def request_span(self, request_id: str, out: RequestOutput, params: SamplingParams, model: str,
                     priority: int, trace_headers: dict[str, str] | None) -> None:
        m = RequestMetrics.merged(out.metrics)
        if m is None or m.arrival_time is None:
            return   # the engine never saw it (it died first): no timeline to show
        epoch = _EpochClock()
        end = m.finished_time if m.finished_time is not None else time.monotonic()
        attrs = span_attributes(request_id, out, params, model, m)
        attrs["conveyor.priority"] = priority
        parent = self._propagate.extract(trace_headers or {})
        span = self.tracer.start_span(SPAN_NAME, context=parent, kind=self._kind,
                                      start_time=epoch.ns(m.arrival_time), attributes=attrs)
        inside = self._trace.set_span_in_context(span)
        for name, start, stop in phases(m, end):
            self.tracer.start_span(name, context=inside, start_time=epoch.ns(start)).end(end_time=epoch.ns(stop))
        for i, t in enumerate(m.preemption_times):
            span.add_event("preemption", {"conveyor.preemption.index": i}, timestamp=epoch.ns(t))
        if out.error is not None:
            span.set_status(self._status(self._error, out.error))
        span.end(end_time=epoch.ns(end))


def span_attributes(request_id: str, out: RequestOutput, params: SamplingParams, model: str,
                    m: RequestMetrics) -> dict[str, Any]:
    prompt = len(out.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in out.outputs)
    attrs: dict[str, Any] = {
        "gen_ai.request.id": request_id, "gen_ai.response.model": model,
        "gen_ai.request.max_tokens": params.max_tokens, "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p, "gen_ai.request.n": params.n,
        "gen_ai.usage.prompt_tokens": prompt, "gen_ai.usage.completion_tokens": completion,
        "gen_ai.usage.num_sequences": len(out.outputs),
        "gen_ai.response.finish_reasons": [c.finish_reason or "" for c in out.outputs],
        "gen_ai.latency.time_in_queue": m.queue_time, "gen_ai.latency.time_to_first_token": m.ttft,
        "gen_ai.latency.e2e": m.e2e,
        "conveyor.num_preemptions": m.num_preemptions,
    }
    if m.first_scheduled_time is not None and m.first_token_time is not None:
        attrs["gen_ai.latency.time_in_model_prefill"] = m.first_token_time - m.first_scheduled_time
    if m.first_token_time is not None and m.last_token_time is not None:
        attrs["gen_ai.latency.time_in_model_decode"] = m.last_token_time - m.first_token_time
    if m.first_scheduled_time is not None and m.last_token_time is not None:
        attrs["gen_ai.latency.time_in_model_inference"] = m.last_token_time - m.first_scheduled_time
    if out.error_code is not None:
        attrs["error.type"] = out.error_code
    return {k: v for k, v in attrs.items() if v is not None}


def phases(m: RequestMetrics, end: float) -> list[tuple[str, float, float]]:
    """(name, start, end) of queue (arrival to first scheduled), prefill (to the first token) and
    decode (to the last token); a phase the request never reached is left out, one it was in when
    it ended (an abort, a failure) ends then."""
    out = [("queue", m.arrival_time, m.first_scheduled_time if m.first_scheduled_time is not None else end)]
    if m.first_scheduled_time is not None:
        out.append(("prefill", m.first_scheduled_time, m.first_token_time if m.first_token_time is not None else end))
    if m.first_token_time is not None:
        out.append(("decode", m.first_token_time, m.last_token_time if m.last_token_time is not None else end))
    return out


class _EpochClock:
    """Monotonic seconds (the engine's clock; system-wide on one machine, so the engine process's
    stamps read the same) to epoch nanoseconds, with one offset taken now."""

    __slots__ = ("offset",)

    def __init__(self):
        self.offset = time.time_ns() - time.monotonic_ns()

    def ns(self, t: float) -> int:
        return round(t * 1e9) + self.offset
