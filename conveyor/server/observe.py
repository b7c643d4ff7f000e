"""Per-request observability: one JSON log line per finished API request (`--log-requests`) and
one OpenTelemetry span per engine request (`--otlp-traces-endpoint`, see tracing.py).

Both join what only the HTTP side knows (endpoint, status, a caller's ``traceparent``) with what
only the engine knows (token counts, finish reasons, the request's timeline in RequestMetrics).
``ObserveMiddleware`` opens a record per API request and makes it current (a contextvar);
``serving.submit`` names the engine requests it started (``submitted``); the engine's finished
listener hands each finished RequestOutput to its record. A record is written once its HTTP
response has ended *and* every engine request has reported -- so a request that failed validation
(no engine request) is written when its 400 is sent, and one whose client went away when the
engine answers the abort. Off (the default) nothing here is installed: ``submitted`` reads one
contextvar and returns.
"""

from __future__ import annotations

import json
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conveyor.frontend.outputs import RequestOutput
from conveyor.request import RequestMetrics
from conveyor.sampling.params import SamplingParams

from conveyor.server.tracing import RequestTracer   # imports OpenTelemetry only when a tracer is made

if TYPE_CHECKING:
    from conveyor.frontend.client import RequestStream

logger = logging.getLogger("conveyor.requests")

_current: ContextVar[_Record | None] = ContextVar("conveyor_observed_request", default=None)
_ERROR_BODY_LIMIT = 64 << 10   # error bodies are small JSON; never buffer more than this


@dataclass(slots=True)
class _Engine:
    """One engine request of an API request."""

    params: SamplingParams
    output: RequestOutput | None = None


@dataclass(slots=True)
class _Record:
    observer: RequestObserver
    endpoint: str
    arrival: float                           # time.time() when the HTTP request came in
    trace_headers: dict[str, str] | None     # traceparent / tracestate, when tracing
    request_id: str | None = None            # the API request's id (engine requests: it or it-i)
    priority: int = 0
    engine: dict[str, _Engine] = field(default_factory=dict)
    http_status: int | None = None
    error_body: bytearray | None = None
    http_done: bool = False
    written: bool = False

    @property
    def complete(self) -> bool:
        return self.http_done and all(e.output is not None for e in self.engine.values())


def _observed(path: str) -> bool:
    """The API routes that run engine requests (scoring also answers at vLLM's unversioned paths)."""
    return path.startswith(("/v1/", "/v2/")) or path in ("/score", "/rerank")


class RequestObserver:
    """The registry of API requests in flight and what is written when they end."""

    def __init__(self, model: str, log_requests: bool = False, log_text: bool = False,
                 tracer: RequestTracer | None = None):
        self.model = model
        self.log_requests, self.log_text, self.tracer = log_requests, log_text, tracer
        self._by_engine_id: dict[str, _Record] = {}

    # ---- hooks: the middleware (opened, closed), serving.submit, the engine's listener ----------
    def opened(self, scope: Scope) -> _Record:
        headers = None
        if self.tracer is not None:
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
                       if k in (b"traceparent", b"tracestate")} or None
        return _Record(self, scope["path"], time.time(), headers)

    def submitted(self, record: _Record, base_id: str, streams: list[RequestStream],
                  params: list[SamplingParams], priority: int) -> None:
        record.request_id, record.priority = base_id, priority
        for stream, sp in zip(streams, params):
            record.engine[stream.request_id] = _Engine(sp)
            self._by_engine_id[stream.request_id] = record

    def finished(self, out: RequestOutput) -> None:
        """The engine's finished listener (every finished output; those of other requests are ignored)."""
        record = self._by_engine_id.pop(out.request_id, None)
        if record is None:
            return
        record.engine[out.request_id].output = out
        self._maybe_write(record)

    def closed(self, record: _Record) -> None:
        record.http_done = True
        self._maybe_write(record)

    # ---- writing ------------------------------------------------------------------------------
    def _maybe_write(self, record: _Record) -> None:
        if record.written or not record.complete:
            return
        record.written = True
        try:
            if self.tracer is not None:
                for rid, e in record.engine.items():
                    self.tracer.request_span(rid, e.output, e.params, self.model, record.priority,
                                             record.trace_headers)
            if self.log_requests:
                logger.info(json.dumps(self.log_line(record), ensure_ascii=False, separators=(",", ":")))
        except Exception:   # noqa: BLE001 - observability must never break serving
            logging.getLogger(__name__).exception("observing request %s failed", record.request_id)

    def log_line(self, r: _Record) -> dict[str, Any]:
        outs = [e.output for e in r.engine.values() if e.output is not None]
        m = RequestMetrics.merged([x for o in outs for x in o.metrics])
        line: dict[str, Any] = {
            "request_id": r.request_id, "endpoint": r.endpoint, "model": self.model, "status": status_of(r),
            "http_status": r.http_status, "priority": r.priority,
            "n": next(iter(r.engine.values())).params.n if r.engine else None,
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs) if outs else None,
            "output_tokens": sum(len(c.token_ids) for o in outs for c in o.outputs) if outs else None,
            "cached_tokens": sum(o.num_cached_tokens for o in outs) if outs else None,
            "finish_reasons": [c.finish_reason for o in outs for c in o.outputs],
            "arrival_time": round(r.arrival, 6),
            "queue_time": _seconds(m, "queue_time"), "ttft": _seconds(m, "ttft"), "e2e": _seconds(m, "e2e"),
            "num_preemptions": m.num_preemptions if m is not None else 0,
        }
        if len(outs) > 1:
            line["num_prompts"] = len(outs)
        if self.log_text:
            line["prompt"] = [o.prompt for o in outs] if len(outs) > 1 else (outs[0].prompt if outs else None)
            line["output"] = [c.text for o in outs for c in o.outputs]
        return line


def submitted(base_id: str, streams: list[RequestStream], params: list[SamplingParams], priority: int) -> None:
    """serving.submit's hook: the engine requests an API request started (a no-op unless observed)."""
    record = _current.get()
    if record is not None:
        record.observer.submitted(record, base_id, streams, params, priority)


class ObserveMiddleware:
    """Opens a record for each API request (POST /v1/..., and the unversioned /score, /rerank, /v2/rerank), notes its status (and error code), and
    closes it when the response has ended, however it ends."""

    def __init__(self, app: ASGIApp, observer: RequestObserver):
        self.app = app
        self.observer = observer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not _observed(scope["path"]):
            return await self.app(scope, receive, send)
        record = self.observer.opened(scope)

        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.http_status = message["status"]
                if record.http_status >= 400:
                    record.error_body = bytearray()
            elif message["type"] == "http.response.body" and record.error_body is not None:
                if len(record.error_body) < _ERROR_BODY_LIMIT:
                    record.error_body += message.get("body", b"")
            await send(message)

        token = _current.set(record)
        try:
            await self.app(scope, receive, watch)
        finally:
            _current.reset(token)
            if record.http_status is None:   # nothing was sent: uvicorn answers 500 for an app that raised
                record.http_status = 500
            self.observer.closed(record)


def status_of(r: _Record) -> str:
    """ok, aborted (the client went away, or the server shut down mid-stream), or the error's code."""
    if r.http_status == 499:
        return "aborted"
    if r.http_status is not None and r.http_status >= 400:
        return _error_code(r.error_body) or f"http_{r.http_status}"
    outs = [e.output for e in r.engine.values() if e.output is not None]
    for o in outs:
        if o.error is not None:
            return o.error_code or "engine_error"
    if any(c.finish_reason == "abort" for o in outs for c in o.outputs):
        return "aborted"
    return "ok"


def _error_code(body: bytearray | None) -> str | None:
    try:
        error = json.loads(bytes(body or b""))["error"]
        return error.get("code") or error.get("type")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _seconds(m: RequestMetrics | None, name: str) -> float | None:
    value = None if m is None or m.arrival_time is None else getattr(m, name)
    return None if value is None else round(value, 6)


def log_to_file(path: str) -> None:
    """--request-log-file: the request log's lines go to `path` (JSON lines, nothing else) instead of stderr."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)


def install(app: Any, client: Any, model: str, log_requests: bool, log_text: bool, tracer_provider: Any) -> None:
    """build_app's hook: the middleware and the engine's finished listener."""
    tracer = RequestTracer(tracer_provider) if tracer_provider is not None else None
    observer = RequestObserver(model, log_requests, log_text, tracer)
    client.add_finished_listener(observer.finished)
    app.add_middleware(ObserveMiddleware, observer=observer)
