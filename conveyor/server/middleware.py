"""Pure-ASGI middleware: request body size limit and API key check (they run before routing)."""

from __future__ import annotations

import secrets
from collections.abc import Collection

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conveyor.server.errors import APIError, error_response


class BodyLimitMiddleware:
    """413 for bodies over `max_bytes`, by Content-Length or by the bytes actually streamed in.

    The body is read here in full (the JSON routes need all of it anyway) and replayed to the
    app; later receive() calls (http.disconnect) pass straight through.
    """

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":   # disconnected before the body was complete
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._too_large(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        err = APIError(413, f"the request body is larger than the limit of {self.max_bytes} bytes",
                       code="request_too_large")
        await error_response(scope, err)(scope, receive, send)


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` or `x-api-key: <key>` (what Anthropic's clients send)
    holds one of the keys; the key it holds goes to the request's state (``request.state.api_key``: its
    tenant, server/tenants.py). Paths in `open_paths` stay open."""

    def __init__(self, app: ASGIApp, api_key: str | list[str], open_paths: Collection[str] = ("/health", "/metrics")):
        self.app = app
        self.keys = [k.encode() for k in ([api_key] if isinstance(api_key, str) else api_key)]
        self.open_paths = set(open_paths)

    def _match(self, headers: dict[bytes, bytes]) -> bytes | None:
        bearer, x_key = headers.get(b"authorization", b""), headers.get(b"x-api-key", b"")
        found = None
        for key in self.keys:   # (every key compared, in constant time each)
            if secrets.compare_digest(bearer, b"Bearer " + key) | secrets.compare_digest(x_key, key):
                found = key
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        key = self._match(dict(scope["headers"]))
        if key is None:
            err = APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>' or "
                                "'x-api-key: <key>')", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await error_response(scope, err)(scope, receive, send)
        scope.setdefault("state", {})["api_key"] = key.decode()
        await self.app(scope, receive, send)
