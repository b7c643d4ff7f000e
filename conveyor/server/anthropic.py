"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat pipeline.

A request is translated into a `ChatCompletionRequest` and runs the chat path's pieces (template,
sampling, context check, submit); the output is read by `parsing.OutputStream` (reasoning, text,
tool calls) and answered as Anthropic content blocks, or streamed as Anthropic's SSE events.
Errors under /v1/messages have Anthropic's shape (`format_errors_under`).

- Messages: user / assistant, content a string or text, tool_use, tool_result (and, in assistant
  history, thinking) blocks. tool_use becomes an assistant message's `tool_calls`, tool_result a
  `role: "tool"` message; past thinking blocks are dropped from the prompt.
- tools / tool_choice: auto, any (= OpenAI "required": a grammar forces calls), tool (one named
  function), none; `disable_parallel_tool_use` = `parallel_tool_calls: false`.
- thinking: with ``--reasoning-parser`` and ``thinking`` enabled the model's reasoning comes back
  as thinking blocks (with an empty signature); not enabled, reasoning the model writes anyway is
  dropped. `type` is passed to the chat template as `enable_thinking` (templates that
  ignore it ignore it); `budget_tokens` is accepted but not enforced (max_tokens caps everything).
- A last assistant message is continued (prefill): the response's text follows on from it.
- max_tokens, which the API requires, is capped at what the context leaves after the prompt
  (clients send large fixed values); a prompt that does not fit is a 400.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from conveyor.frontend.outputs import CompletionOutput, RequestOutput
from conveyor.server import openapi
from conveyor.server.errors import APIError, format_errors_under
from conveyor.server.inputs import Prompt, chat_prompt, chat_sampling, off_loop_if_big, process_request, text_chars
from conveyor.server.parsing import (ContentDelta, OutputStream, ReasoningDelta, ToolArgsDelta, ToolCallStart,
                                     parse_output)
from conveyor.server.protocol import ChatCompletionRequest, ChatMessage
from conveyor.server.reasoning import parser_for
from conveyor.server.serving import (EngineStreamingResponse, abort, cancel_on_disconnect, check_output,
                                     collect_finals, merged, submit)
from conveyor.server.state import ServerState
from conveyor.server.tools import ToolPlan, plan_tools

PREFIX = "/v1/messages"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")   # an unknown field is a 400 naming it, as everywhere


# ---- requests -------------------------------------------------------------------------------

class CacheControl(_Body):
    type: Literal["ephemeral"] = "ephemeral"
    ttl: str | None = None


class TextBlock(_Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None   # a caching hint: prefix caching here is automatic


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None


class ThinkingBlock(_Body):   # an earlier answer's reasoning, sent back with the history
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Body):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                  Field(discriminator="type")]


class Message(_Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None   # server tools (web search, bash, ...) are not implemented
    cache_control: CacheControl | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('name is required with type "tool" and only with it')
        return self


class Thinking(_Body):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=1)


class OutputFormat(_Body):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    format: OutputFormat | None = None   # structured outputs (the schema constrains the text)


class CountTokensRequest(_Body):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None   # {"user_id": ...}: bookkeeping, no effect on the output
    service_tier: Literal["auto", "standard_only"] | None = None   # one tier here


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Anthropic's error shape, what every error under /v1/messages answers (error_body)."""
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


# ---- translation into a chat request --------------------------------------------------------

def _parts(blocks: list[TextBlock]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": b.text} for b in blocks]


def chat_messages(req: CountTokensRequest) -> list[ChatMessage]:
    """The conversation as OpenAI chat messages (text blocks as text parts, joined as chat joins them)."""
    out: list[ChatMessage] = []
    if req.system:
        out.append(ChatMessage(role="system", content=req.system if isinstance(req.system, str)
                               else _parts(req.system)))
    for m in req.messages:
        if isinstance(m.content, str):
            out.append(ChatMessage(role=m.role, content=m.content))
            continue
        texts: list[TextBlock] = []
        calls: list[dict[str, Any]] = []
        for block in m.content:
            if isinstance(block, TextBlock):
                texts.append(block)
            elif isinstance(block, ToolUseBlock):
                if m.role != "assistant":
                    raise APIError(400, "tool_use blocks belong in assistant messages", param="messages")
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input)}})
            elif isinstance(block, ToolResultBlock):
                if m.role != "user":
                    raise APIError(400, "tool_result blocks belong in user messages", param="messages")
                if texts:   # text before a result stays before it
                    out.append(ChatMessage(role="user", content=_parts(texts)))
                    texts = []
                out.append(_tool_message(block))
            # thinking blocks of earlier turns are not part of the prompt
        if calls:
            out.append(ChatMessage(role="assistant", content=_parts(texts) or None, tool_calls=calls))
        elif texts or all(isinstance(b, (ThinkingBlock, RedactedThinkingBlock)) for b in m.content):
            out.append(ChatMessage(role=m.role, content=_parts(texts)))
    return out


def _tool_message(block: ToolResultBlock) -> ChatMessage:
    text = block.content if isinstance(block.content, str) else "".join(b.text for b in block.content)
    return ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=f"Error: {text}" if block.is_error
                       else text)


def chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    fields: dict[str, Any] = {"model": req.model, "messages": chat_messages(req)}
    if req.tools:
        fields["tools"] = [{"type": "function", "function": _function(t)} for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            choice.type, {"type": "function", "function": {"name": choice.name}})
        if choice.disable_parallel_tool_use is not None:
            fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if req.thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
    if req.output_config is not None and req.output_config.format is not None:
        fields["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": "output", "schema": req.output_config.format.json_schema}}
    if isinstance(req, MessagesRequest):
        fields.update(max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
                      top_p=req.top_p, top_k=req.top_k, stream=req.stream)
    return ChatCompletionRequest(**fields)


def _function(tool: Tool) -> dict[str, Any]:
    fn = {"name": tool.name, "description": tool.description, "parameters": tool.input_schema}
    return {k: v for k, v in fn.items() if v is not None}


def _prompt(state: ServerState, chat: ChatCompletionRequest, tools: ToolPlan | None) -> Prompt:
    """The rendered conversation; a last assistant message (without tool calls) is continued, not
    answered (Anthropic's prefill: the response continues its text)."""
    last = chat.messages[-1]
    prefill = last.role == "assistant" and not getattr(last, "tool_calls", None)
    return chat_prompt(state.client, chat.messages, not prefill, tools, None, prefill, chat.chat_template_kwargs)


# ---- responses ------------------------------------------------------------------------------

def _tool_use(call_id: str, name: str, input: Any = None) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call_id.removeprefix("call_"), "name": name,
            "input": {} if input is None else input}


def _input(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return {}


def _stop(c: CompletionOutput, stop_sequences: list[str] | None, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished output."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(c.stop_reason, str) and c.stop_reason in (stop_sequences or ()):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def _message(mid: str, model: str, content: list[dict], stop: tuple[str | None, str | None], n_in: int,
             n_out: int) -> dict[str, Any]:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1],
            "usage": {"input_tokens": n_in, "output_tokens": n_out}}


def error_body(err: APIError) -> dict[str, Any]:
    """Anthropic's error shape; the type from the status (503, this server's 'overloaded', is
    what Anthropic calls overloaded_error)."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
            529: "overloaded_error"}.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    return AnthropicError(error=AnthropicErrorDetail(type=kind, message=err.message)).model_dump()


# ---- routes ---------------------------------------------------------------------------------

async def create_message(state: ServerState, req: MessagesRequest, raw: Request) -> Response:
    model = state.check_model(req.model)
    chat = chat_request(req)
    tools = plan_tools(chat.tools, chat.tool_choice, chat.parallel_tool_calls, state.tool_call_parser)
    params = chat_sampling(chat, tools, state.client.generation_defaults)
    prompt = await off_loop_if_big(text_chars(chat.messages), _prompt, state, chat, tools)
    tools = tools if tools is not None and tools.active else None
    room = state.client.max_model_len - len(prompt.token_ids)
    if room >= 1 and params.max_tokens > room:   # capped, not refused (a prompt too long is refused below)
        params.max_tokens = room
    request = process_request(state.client, prompt, params, "messages", "max_tokens")
    params = request.params
    mid = f"msg_{uuid.uuid4().hex}"
    streams = submit(state.client, mid, [request], 0, state.origin(raw, req.model), state.tenants)
    if req.stream:
        return EngineStreamingResponse(_events(state, req, model, mid, prompt, tools, streams,
                                               parser_for(state.reasoning_parser, params)), state.client, streams)
    final = (await cancel_on_disconnect(raw, collect_finals(state.client, streams)))[0]
    c = final.outputs[0]
    parsed = parse_output(c.text, tools, parser_for(state.reasoning_parser, params), prompt.text)
    content: list[dict[str, Any]] = []
    if parsed.reasoning and _shows_thinking(req):
        content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    if parsed.content:
        content.append({"type": "text", "text": parsed.content})
    for call in parsed.tool_calls:
        content.append(_tool_use(call["id"], call["function"]["name"], _input(call["function"]["arguments"])))
    stop = _stop(c, req.stop_sequences, bool(parsed.tool_calls))
    return JSONResponse(_message(mid, model, content, stop, len(final.prompt_token_ids), len(c.token_ids)))


async def count_tokens(state: ServerState, req: CountTokensRequest) -> dict[str, int]:
    state.check_model(req.model)
    chat = chat_request(req)
    tools = plan_tools(chat.tools, chat.tool_choice, chat.parallel_tool_calls, state.tool_call_parser)
    prompt = await off_loop_if_big(text_chars(chat.messages), _prompt, state, chat, tools)
    return {"input_tokens": len(prompt.token_ids)}


def _event(kind: str, **data: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


async def _events(state: ServerState, req: MessagesRequest, model: str, mid: str, prompt: Prompt,
                  tools: ToolPlan | None, streams: list, reasoning_parser: str | None) -> AsyncIterator[str]:
    """Anthropic's stream: message_start, per block start / deltas / stop, message_delta, message_stop."""
    parser = OutputStream(tools, reasoning_parser, prompt.text)
    thinking = _shows_thinking(req)
    n_in = len(prompt.token_ids)
    index, kind = -1, None   # the open content block (kind None: none open)

    def open_block(block: dict[str, Any]) -> list[str]:
        nonlocal index, kind
        out = close_block()
        index, kind = index + 1, block["type"]
        return out + [_event("content_block_start", index=index, content_block=block)]

    def close_block() -> list[str]:
        nonlocal kind
        if kind is None:
            return []
        kind = None
        return [_event("content_block_stop", index=index)]

    def translate(e: ReasoningDelta | ContentDelta | ToolCallStart | ToolArgsDelta) -> list[str]:
        out: list[str] = []
        if isinstance(e, ReasoningDelta) and e.text and thinking:
            if kind != "thinking":
                out += open_block({"type": "thinking", "thinking": "", "signature": ""})
            out.append(_event("content_block_delta", index=index,
                              delta={"type": "thinking_delta", "thinking": e.text}))
        elif isinstance(e, ContentDelta) and e.text:
            if kind != "text":
                out += open_block({"type": "text", "text": ""})
            out.append(_event("content_block_delta", index=index, delta={"type": "text_delta", "text": e.text}))
        elif isinstance(e, ToolCallStart):
            out += open_block(_tool_use(e.id, e.name))
        elif isinstance(e, ToolArgsDelta) and e.text:
            out.append(_event("content_block_delta", index=index,
                              delta={"type": "input_json_delta", "partial_json": e.text}))
        return out

    yield _event("message_start", message=_message(mid, model, [], (None, None), n_in, 0))
    final: RequestOutput | None = None
    try:
        async for _, out in merged(streams):
            check_output(out)
            c = out.outputs[0]
            for e in parser.feed(c.delta_text, c.finished):
                for line in translate(e):
                    yield line
            if out.finished:
                final = out
    except APIError as e:
        yield _event("error", error=error_body(e)["error"])
        return
    finally:
        abort(state.client, streams)
    for line in close_block():
        yield line
    if final is None:   # the engine ended the stream without a result
        yield _event("error", error={"type": "api_error", "message": "the engine ended the request without a result"})
        return
    c = final.outputs[0]
    reason, sequence = _stop(c, req.stop_sequences, bool(parser.calls))
    yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                 usage={"output_tokens": len(c.token_ids)})
    yield _event("message_stop")


def _shows_thinking(req: MessagesRequest) -> bool:
    """Thinking blocks only for a request that enabled thinking (as Anthropic's API); otherwise the
    reasoning a model writes anyway is dropped, not mixed into the text."""
    return req.thinking is not None and req.thinking.type != "disabled"


def register_anthropic_routes(app: FastAPI, state: ServerState) -> None:
    format_errors_under(app, PREFIX, error_body)

    @app.post(PREFIX, responses=openapi.responses(openapi.ENGINE, streams=True, shape=AnthropicError))
    async def messages(body: MessagesRequest, raw: Request) -> Response:
        return await create_message(state, body, raw)

    @app.post(PREFIX + "/count_tokens", responses=openapi.responses(openapi.BODY, shape=AnthropicError))
    async def messages_count_tokens(body: CountTokensRequest) -> dict[str, int]:
        return await count_tokens(state, body)
