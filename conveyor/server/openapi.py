"""What /openapi.json says each route answers: its errors, their body, and its event stream.

Every route declares its answers through FastAPI's ``responses=``, built here from one table of
error statuses, so the document is generated from the same declarations as the routes. An error
body is OpenAI's ``{"error": {"message", "type", "param", "code"}}`` (``ErrorResponse``, the model
errors.py sends), or another API's shape under its prefix (Anthropic's under /v1/messages).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from conveyor.server.protocol import ErrorResponse

Responses = dict[int | str, dict[str, Any]]

# When each status is sent; the descriptions in the document.
_WHEN = {
    400: "Invalid request: malformed JSON, a missing field or a wrong type or value, an unsupported field, a prompt "
         "that does not fit the context (`code` context_length_exceeded).",
    401: "The server runs with --api-key and the request has neither `Authorization: Bearer <key>` nor "
         "`x-api-key: <key>`.",
    404: "Not found: a model this server does not serve, or a stored response it does not hold.",
    413: "The request body is larger than --max-body-bytes.",
    429: "The request's tenant already has --tenant-max-requests requests in flight; with a Retry-After header.",
    500: "Internal error: the engine failed the request, or an unexpected exception (`code` internal_error).",
    503: "Overloaded (the queue is full, or the request waited longer than its max_queue_time), shutting down, or "
         "the engine is dead; with a Retry-After header where retrying can succeed.",
}

# Which statuses a route can send, by what it does. The API key check (middleware.py) and the last-resort
# handler (errors.py) answer every route the key protects; /health and /metrics stay open.
OPEN = (500,)
HEALTH = (503, *OPEN)                 # the engine is not running
ANY = (401, 500)
LOOKUP = (404, *ANY)                  # names a stored object (a model, a response) in its path
CHECKED = (400, *LOOKUP)              # ... and checks its parameters or the object's state (paging, cancel)
BODY = (400, 404, 413, *ANY)          # a JSON body, which may name a model (404 for one not served)
ENGINE = (429, 503, *BODY)            # submits work to the engine (429: a tenant over its cap)

HEALTHY = ("The engine runs and accepts work: an empty body (under data parallelism, JSON saying which replicas "
           "are up).")
_EVENT_STREAM = {"text/event-stream": {"schema": {"type": "string"}}}
_STREAMED = ("JSON; with `stream: true`, server-sent events (text/event-stream) whose data are JSON objects "
             "(OpenAI's streams end with `data: [DONE]`; an error after the stream started is an error event).")


def responses(statuses: Iterable[int], ok: type[BaseModel] | None = None, *, streams: bool = False,
              text: str | None = None, shape: type[BaseModel] = ErrorResponse) -> Responses:
    """A route's `responses=`: its 200 and its error `statuses`, each with the `shape` the route's
    errors have. The 200 is `ok`'s JSON, and with `streams` an event stream instead; or `text`, a
    text media type (the route's response_class must then be Response: FastAPI documents models
    under the route's own media type, and the errors are JSON)."""
    table: Responses = {s: {"model": shape, "description": _WHEN[s]} for s in sorted(set(statuses))}
    success: dict[str, Any] = {}
    if ok is not None:
        success["model"] = ok
    if streams:
        success |= {"content": _EVENT_STREAM, "description": _STREAMED}
    if text is not None:
        success["content"] = {text: {"schema": {"type": "string"}}}
    return ({200: success} if success else {}) | table


def without_validation_422(app: FastAPI) -> None:
    """FastAPI documents a 422 for every route with parameters; this server answers validation
    errors 400 (errors.py), which the routes declare, so the document drops the 422s it never sends."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = generate()
            for item in doc.get("paths", {}).values():
                for operation in item.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                doc.get("components", {}).get("schemas", {}).pop(name, None)
        return app.openapi_schema

    app.openapi = openapi   # type: ignore[method-assign]
