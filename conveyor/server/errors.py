"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}} for every failure."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Container, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conveyor.errors import InvalidRequestError
from conveyor.server.openapi import without_validation_422
from conveyor.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
          503: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        return _ErrorResponse(self.body(), status_code=self.status, headers=self.headers)


class _ErrorResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message quoting user input that holds a lone
    surrogate must still encode (it would raise in UTF-8)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


ErrorFormatter = Callable[[APIError], dict[str, Any]]


def format_errors_under(app: FastAPI, prefix: str, formatter: ErrorFormatter) -> None:
    """Errors answered for paths under `prefix` get `formatter`'s body (another API's error shape,
    e.g. Anthropic's under /v1/messages): every error the app answers, from the handlers, the
    middleware (API key, body size) and the last-resort 500, goes through `error_response`."""
    if not hasattr(app.state, "error_formatters"):
        app.state.error_formatters = {}
    app.state.error_formatters[prefix.rstrip("/")] = formatter


def error_response(scope: Scope, err: APIError) -> JSONResponse:
    """`err` as the response for this request: its path's API shape (format_errors_under), else OpenAI's."""
    path = scope.get("path", "")
    formatters = getattr(getattr(scope.get("app"), "state", None), "error_formatters", None) or {}
    for prefix, formatter in formatters.items():
        if path == prefix or path.startswith(prefix + "/"):
            return _ErrorResponse(formatter(err), status_code=err.status, headers=err.headers)
    return err.response()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def invalid_request(error: ValueError, rename: Mapping[str, str | None] | None = None,
                    known: Container[str] | None = None) -> APIError:
    """A 400 for a validation error, its ``param`` and ``code`` taken from the error's attributes
    (never from its text). `rename`: the engine's parameter names this endpoint calls otherwise
    (None: no single field of the request is to blame); `known`: the endpoint's fields (a name
    outside them is not reported). A plain ValueError names no parameter."""
    if not isinstance(error, InvalidRequestError):
        return bad_request(str(error))
    if rename and error.param in rename:
        error = error.renamed(rename[error.param])
    param = error.param if known is None or error.param in known else None
    return bad_request(str(error), param, error.code)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    if first.get("loc") == ("body",):
        return ("the body must be a JSON object, sent with Content-Type: application/json "
                f"({first.get('msg')})"), None
    unsupported = [str(e["loc"][-1]) for e in errors if e.get("type") == "extra_forbidden" and e.get("loc")]
    if unsupported:   # a field we do not implement must not be silently ignored
        names = ", ".join(map(repr, unsupported))
        return (f"unsupported field{'s' if len(unsupported) > 1 else ''} {names}: this server does not implement "
                f"{'them' if len(unsupported) > 1 else 'it'}, and ignoring it would change what you asked for"), \
            unsupported[0]
    # A union field (e.g. prompt) fails once per alternative; report the field, not each alternative.
    fields = [next((str(p) for p in e.get("loc", ()) if p != "body"), None) for e in errors]
    param = fields[0]
    same = [e for e, f in zip(errors, fields) if f == param]
    msgs = list(dict.fromkeys(e.get("msg", "invalid value") for e in same))
    what = msgs[0] if len(msgs) == 1 else "matches none of the accepted forms (" + "; ".join(msgs) + ")"
    more = len(errors) - len(same)
    return f"{param}: {what}" + (f" (and {more} more errors)" if more else ""), param


def install_error_handlers(app: FastAPI) -> None:
    without_validation_422(app)   # validation errors are answered 400 (below)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request.scope, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(request.scope, bad_request(message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return error_response(request.scope, APIError(exc.status_code, str(exc.detail), code=code,
                                                      headers=exc.headers))


class InternalErrorMiddleware:
    """Any other exception: an OpenAI-style 500, and the keep-alive connection stays usable.

    (Starlette's own last-resort handler re-raises after answering, and uvicorn then drops the
    connection, failing the client's next request on it too.) A response already under way
    (a stream) cannot change its status: it is cut, and the error is logged.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:   # noqa: BLE001 - the last resort
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if not started:
                err = APIError(500, f"internal server error: {type(exc).__name__}", code="internal_error")
                await error_response(scope, err)(scope, receive, send)
