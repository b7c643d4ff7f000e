"""Plumbing shared by the completion routes: submit, merge streams, abort, SSE, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from conveyor.core.engine_core import EngineDeadError

from conveyor.frontend.client import EngineClient, Overloaded, RequestStream
from conveyor.frontend.outputs import RequestOutput
from conveyor.scheduler.deadlines import QUEUE_TIMEOUT
from conveyor.server import observe
from conveyor.server.errors import APIError
from conveyor.server.tenants import Origin, Tenants
from conveyor.frontend.inputs import ProcessedRequest

T = TypeVar("T")

RETRY_AFTER_S = 1
NO_ORIGIN = Origin()
DONE = "data: [DONE]\n\n"


@dataclass(slots=True)
class Job:
    """One HTTP request's identity in its responses: id, creation time, model, n, logprobs."""

    id: str
    created: int
    model: str
    n: int
    num_logprobs: int | None


def submit(client: EngineClient, base_id: str, requests: list[ProcessedRequest], priority: int,
           origin: Origin = NO_ORIGIN, tenants: Tenants | None = None) -> list[RequestStream]:
    """One engine request per processed prompt (`base_id`-i), for `origin`'s tenant and adapter; all or
    none: on failure the rest is aborted. `tenants`: the server's book of them (429 for a tenant over
    its cap; every request counted until it finishes)."""
    if tenants is not None:
        tenants.admit(origin.tenant, len(requests))
    if origin != NO_ORIGIN:
        requests = [dataclasses.replace(r, tenant=origin.tenant, lora=origin.lora) for r in requests]
    streams: list[RequestStream] = []
    try:
        for i, request in enumerate(requests):
            rid = base_id if len(requests) == 1 else f"{base_id}-{i}"
            streams.append(client.add_request(request, None, rid, priority))
            if tenants is not None:
                tenants.started(rid, origin.tenant)
    except Overloaded as e:
        abort(client, streams)
        raise APIError(503, f"the server is overloaded: {e}; retry later", code="overloaded",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from e
    except EngineDeadError as e:
        abort(client, streams)
        raise APIError(503, str(e), code="unavailable", headers={"Retry-After": str(RETRY_AFTER_S)}) from e
    observe.submitted(base_id, streams, [r.params for r in requests], priority)   # request log / tracing (no-op when off)
    return streams


def abort(client: EngineClient, streams: list[RequestStream]) -> None:
    for s in streams:
        if not s.finished:
            client.abort(s.request_id)


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from all streams as they come."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        async for out in stream:
            queue.put_nowait((i, out))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out = await queue.get()
            if out is None:
                remaining -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()


async def collect_finals(client: EngineClient, streams: list[RequestStream]) -> list[RequestOutput]:
    """Every stream's finished output, in order (non-streaming responses); aborts the rest on exit."""
    finals: list[RequestOutput] = [None] * len(streams)   # type: ignore[list-item]
    try:
        async for i, out in merged(streams):
            check_output(out)
            if out.finished:
                finals[i] = out
    finally:
        abort(client, streams)
    return finals


def check_output(out: RequestOutput) -> None:
    """Raise the APIError an engine-side failure or a shutdown abort stands for."""
    if out.error is not None:
        if out.error_code == QUEUE_TIMEOUT:   # overloaded, nothing ran: retry later (as for a full queue)
            raise APIError(503, out.error, code=QUEUE_TIMEOUT, headers={"Retry-After": str(RETRY_AFTER_S)})
        raise APIError(500, f"the request failed in the engine: {out.error}")
    if any(c.finish_reason == "abort" for c in out.outputs):
        raise APIError(503, "the request was aborted: the server is shutting down", code="unavailable",
                       headers={"Retry-After": str(RETRY_AFTER_S)})


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it if the client goes away first (its finally blocks abort requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and watcher.exception() is not None:   # cannot watch: just wait
            await asyncio.wait({task})
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise APIError(499, "the client closed the connection")
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(chunk: BaseModel | dict) -> str:
    data = chunk.model_dump_json() if isinstance(chunk, BaseModel) else json.dumps(chunk)
    return f"data: {data}\n\n"


def sse_error(err: APIError) -> str:
    return sse(err.body())


def finish_reason(reason: str | None) -> str | None:
    # The engine's "stop" (eos, stop string or stop token) and "length" are the API's values.
    return reason if reason in (None, "stop", "length") else "stop"


class EngineStreamingResponse(StreamingResponse):
    """A StreamingResponse that aborts its engine requests however it ends, even before the
    body generator first runs (a client gone before the headers were sent)."""

    def __init__(self, content: AsyncIterator[str], client: EngineClient, streams: list[RequestStream]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._client, self._streams = client, streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            abort(self._client, self._streams)
