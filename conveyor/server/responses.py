"""POST /v1/responses: a minimal OpenAI Responses API — text in (a string or message items, plus
`instructions`), text out (one assistant message), streamed as the API's typed events; `text.format`
json_object / json_schema go through structured outputs. Tools, previous_response_id, stored
responses and reasoning are not implemented (400 naming the field)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from conveyor.engine.outputs import RequestOutput
from conveyor.sampling.params import SamplingParams
from conveyor.sampling.structured import StructuredOutputsParams
from conveyor.server.errors import APIError, bad_request, invalid_request
from conveyor.server.inputs import chat_prompt, fit_to_context, format_constraint, off_loop_if_big, text_chars
from conveyor.server.protocol import ChatMessage, ResponsesRequest
from conveyor.server.serving import (EngineStreamingResponse, abort, cancel_on_disconnect, check_output,
                                     collect_finals, merged, submit)
from conveyor.server.state import ServerState

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def _messages(req: ResponsesRequest) -> list[ChatMessage]:
    out = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        if not isinstance(item, dict) or item.get("type", "message") != "message" or item.get("role") not in _ROLES:
            raise bad_request(f"input[{i}] must be a message item with role user, system, developer or assistant "
                              "(other item types are not supported)", "input")
        content = item.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
                    raise bad_request(f"input[{i}].content: only input_text/output_text parts are supported", "input")
                parts.append(str(part.get("text", "")))
            content = "".join(parts)
        if not isinstance(content, str):
            raise bad_request(f"input[{i}].content must be a string or a list of text parts", "input")
        out.append(ChatMessage(role=_ROLES[item["role"]], content=content))
    if not out:
        raise bad_request("input must not be empty", "input")
    return out


def _params(req: ResponsesRequest) -> SamplingParams:
    fmt = (req.text or {}).get("format") or {"type": "text"}
    spec = format_constraint(fmt.get("type"), fmt.get("schema"), "text.format", "a schema", "text")
    structured = StructuredOutputsParams(**spec) if spec is not None else None
    if req.store:
        raise bad_request("store is not supported: responses are not kept on the server", "store")
    try:
        return SamplingParams(max_tokens=req.max_output_tokens, structured_outputs=structured,
                              temperature=1.0 if req.temperature is None else req.temperature,
                              top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed)
    except ValueError as e:
        raise invalid_request(e, {"max_tokens": "max_output_tokens"}, type(req).model_fields) from e


def _message_item(item_id: str, text: str, done: bool) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": "completed" if done else "in_progress",
            "role": "assistant", "content": [_text_part(text)] if done else []}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _body(rid: str, created: int, model: str, req: ResponsesRequest, output: list, status: str,
          final: RequestOutput | None = None) -> dict[str, Any]:
    usage = None
    incomplete = None
    if final is not None:
        n_in, n_out = len(final.prompt_token_ids), len(final.outputs[0].token_ids)
        usage = {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": n_out,
                 "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_in + n_out}
        if final.outputs[0].finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    return {"id": rid, "object": "response", "created_at": created, "model": model, "status": status,
            "incomplete_details": incomplete, "instructions": req.instructions, "output": output,
            "parallel_tool_calls": False, "tool_choice": "none", "tools": [], "temperature": req.temperature,
            "top_p": req.top_p, "max_output_tokens": req.max_output_tokens, "usage": usage, "error": None}


async def create_response(state: ServerState, req: ResponsesRequest, raw: Request) -> Response:
    model = state.check_model(req.model)
    params = _params(req)
    messages = _messages(req)
    prompt = await off_loop_if_big(text_chars(messages), chat_prompt, state.client, messages, True)
    params = fit_to_context(state.client, prompt, params, "input", "max_output_tokens")
    rid, item_id, created = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}", int(time.time())
    streams = submit(state.client, rid, [prompt], [params], 0, req.cache_salt)
    if req.stream:
        return EngineStreamingResponse(_events(state, req, model, rid, item_id, created, streams), state.client,
                                       streams)
    final = (await cancel_on_disconnect(raw, collect_finals(state.client, streams)))[0]
    text = final.outputs[0].text
    return JSONResponse(_body(rid, created, model, req, [_message_item(item_id, text, True)], "completed", final))


async def _events(state: ServerState, req: ResponsesRequest, model: str, rid: str, item_id: str, created: int,
                  streams: list) -> AsyncIterator[str]:
    seq = 0

    def event(kind: str, **data: Any) -> str:
        nonlocal seq
        seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **data})}\n\n"

    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    yield event("response.created", response=_body(rid, created, model, req, [], "in_progress"))
    yield event("response.output_item.added", output_index=0, item=_message_item(item_id, "", False))
    yield event("response.content_part.added", part=_text_part(""), **where)
    text, final = "", None
    try:
        async for _, out in merged(streams):
            check_output(out)
            delta = out.outputs[0].delta_text
            if delta:
                text += delta
                yield event("response.output_text.delta", delta=delta, logprobs=[], **where)
            if out.finished:
                final = out
    except APIError as e:
        yield event("error", code=e.code, message=e.message, param=e.param)
        return
    finally:
        abort(state.client, streams)
    yield event("response.output_text.done", text=text, logprobs=[], **where)
    yield event("response.content_part.done", part=_text_part(text), **where)
    item = _message_item(item_id, text, True)
    yield event("response.output_item.done", output_index=0, item=item)
    body = _body(rid, created, model, req, [item], "completed", final)
    # Always response.completed (the body's status says incomplete when max_output_tokens cut it):
    # the SDK's stream helper waits for that event and fails on response.incomplete.
    yield event("response.completed", response=body)
