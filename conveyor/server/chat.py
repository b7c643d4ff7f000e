"""POST /v1/chat/completions: the model's chat template, OpenAI chat responses and chunks."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from conveyor.engine.outputs import CompletionOutput, RequestOutput
from conveyor.server.completions import usage_of
from conveyor.server.errors import APIError
from conveyor.server.inputs import chat_prompt, chat_sampling, fit_to_context, off_loop_if_big, text_chars
from conveyor.server.logprobs import chat_logprobs
from conveyor.server.protocol import (ChatChoice, ChatChoiceLogprobs, ChatCompletionChunk, ChatCompletionRequest,
                                      ChatCompletionResponse, ChatResponseMessage, ChatStreamChoice, DeltaMessage)
from conveyor.server.serving import (DONE, EngineStreamingResponse, abort, cancel_on_disconnect, check_output,
                                     Job, finish_reason, merged, sse, sse_error, submit)
from conveyor.server.state import ServerState
from conveyor.server.tools import ToolPlan, parse_tool_calls, plan_tools


@dataclass(slots=True)
class _Job(Job):
    def chunk(self, choice: ChatStreamChoice) -> str:
        return sse(ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice]))


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request) -> Response:
    model = state.check_model(req.model)
    tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, state.tool_call_parser)
    params = chat_sampling(req, tools)
    prompt = await off_loop_if_big(text_chars(req.messages), chat_prompt, state.client, req.messages,
                                   req.add_generation_prompt, tools, req.chat_template, req.continue_final_message,
                                   req.chat_template_kwargs)
    tools = tools if tools is not None and tools.active else None
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    params = fit_to_context(state.client, prompt, params, "messages", max_param)
    job = _Job(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model, params.n, params.logprobs)
    streams = submit(state.client, job.id, [prompt], [params], req.priority, req.cache_salt)
    if req.stream:
        usage = req.stream_options is not None and req.stream_options.include_usage
        return EngineStreamingResponse(_stream(state, job, streams, usage, tools), state.client, streams)

    async def collect() -> RequestOutput:
        try:
            async for _, out in merged(streams):
                check_output(out)
                if out.finished:
                    return out
        finally:
            abort(state.client, streams)
        raise APIError(500, "the engine ended the request without a result")

    final = await cancel_on_disconnect(raw, collect())
    choices = []
    for c in final.outputs:
        message, reason = _message(c, tools)
        choices.append(ChatChoice(index=c.index, message=message, logprobs=_logprobs(state, job, c, 0),
                                  finish_reason=reason))
    body = ChatCompletionResponse(id=job.id, created=job.created, model=model, choices=choices,
                                  usage=usage_of([final]))
    return JSONResponse(body.model_dump())


def _message(c: CompletionOutput, tools: ToolPlan | None) -> tuple[ChatResponseMessage, str | None]:
    """The choice's message (tool calls parsed out when tools are in play) and finish reason."""
    reason = finish_reason(c.finish_reason)
    if tools is None:
        return ChatResponseMessage(content=c.text), reason
    content, calls = parse_tool_calls(c.text, tools.parser)
    if not calls:
        return ChatResponseMessage(content=c.text), reason
    return ChatResponseMessage(content=content, tool_calls=calls), "tool_calls" if reason == "stop" else reason


def _logprobs(state: ServerState, job: _Job, c: CompletionOutput, start: int) -> ChatChoiceLogprobs | None:
    if job.num_logprobs is None:
        return None
    return ChatChoiceLogprobs(content=chat_logprobs(state.texts, c.token_ids[start:], (c.logprobs or [])[start:],
                                                    job.num_logprobs))


async def _stream(state: ServerState, job: _Job, streams: list, include_usage: bool,
                  tools: ToolPlan | None = None) -> AsyncIterator[str]:
    done: set[int] = set()
    final: RequestOutput | None = None
    try:
        for i in range(job.n):
            yield job.chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
        async for _, out in merged(streams):
            check_output(out)
            for c in out.outputs:
                if c.index in done:
                    continue
                if c.finished:
                    done.add(c.index)
                for choice in (_tool_deltas(state, job, c, tools) if tools is not None else _text_delta(state, job, c)):
                    yield job.chunk(choice)
            if out.finished:
                final = out
        if include_usage and final is not None:
            yield sse(ChatCompletionChunk(id=job.id, created=job.created, model=job.model, choices=[],
                                          usage=usage_of([final])))
    except APIError as e:
        yield sse_error(e)
    finally:
        abort(state.client, streams)
    yield DONE


def _text_delta(state: ServerState, job: _Job, c: CompletionOutput) -> list[ChatStreamChoice]:
    if not (c.delta_text or c.finished or (job.num_logprobs is not None and c.delta_token_ids)):
        return []
    start = len(c.token_ids) - len(c.delta_token_ids)
    delta = DeltaMessage(content=c.delta_text) if c.delta_text or not c.finished else DeltaMessage()
    return [ChatStreamChoice(index=c.index, delta=delta, logprobs=_logprobs(state, job, c, start),
                             finish_reason=finish_reason(c.finish_reason))]


def _tool_deltas(state: ServerState, job: _Job, c: CompletionOutput, tools: ToolPlan) -> list[ChatStreamChoice]:
    """With tools in play a choice is sent when it ends (calls are parsed from the whole output):
    its content, then one delta per tool call, then the finish."""
    if not c.finished:
        return []
    message, reason = _message(c, tools)
    logprobs, out = _logprobs(state, job, c, 0), []
    if message.content:
        out.append(ChatStreamChoice(index=c.index, delta=DeltaMessage(content=message.content), logprobs=logprobs))
        logprobs = None
    for k, call in enumerate(message.tool_calls or []):
        out.append(ChatStreamChoice(index=c.index, delta=DeltaMessage(tool_calls=[{"index": k, **call}]),
                                    logprobs=logprobs))
        logprobs = None
    out.append(ChatStreamChoice(index=c.index, delta=DeltaMessage(), finish_reason=reason))
    return out
