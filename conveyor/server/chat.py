"""POST /v1/chat/completions: the model's chat template, OpenAI chat responses and chunks."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from conveyor.frontend.outputs import CompletionOutput, RequestOutput
from conveyor.server.completions import usage_of
from conveyor.server.errors import APIError
from conveyor.server.inputs import chat_prompt, chat_sampling, off_loop_if_big, process_request, text_chars
from conveyor.server.logprobs import chat_logprobs
from conveyor.server.protocol import (ChatChoice, ChatChoiceLogprobs, ChatCompletionChunk, ChatCompletionRequest,
                                      ChatCompletionResponse, ChatResponseMessage, ChatStreamChoice, DeltaMessage)
from conveyor.server.serving import (DONE, EngineStreamingResponse, abort, cancel_on_disconnect, check_output,
                                     Job, finish_reason, merged, sse, sse_error, submit)
from conveyor.server.state import ServerState
from conveyor.server.parsing import (ContentDelta, OutputStream, ReasoningDelta, ToolArgsDelta, ToolCallStart,
                                     parse_output)
from conveyor.server.reasoning import parser_for
from conveyor.server.tools import ToolPlan, plan_tools


@dataclass(slots=True)
class _Job(Job):
    tools: ToolPlan | None = None
    reasoning_parser: str | None = None
    prompt_text: str | None = None     # the rendered prompt (whether it opened a <think> block)

    def chunk(self, choice: ChatStreamChoice) -> str:
        return sse(ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice]))

    @property
    def parses(self) -> bool:
        """Whether outputs are read for reasoning or tool calls (else the text is the content)."""
        return self.tools is not None or self.reasoning_parser is not None


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request) -> Response:
    model = state.check_model(req.model)
    tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, state.tool_call_parser)
    params = chat_sampling(req, tools, state.client.generation_defaults)
    prompt = await off_loop_if_big(text_chars(req.messages), chat_prompt, state.client, req.messages,
                                   req.add_generation_prompt, tools, req.chat_template, req.continue_final_message,
                                   req.chat_template_kwargs)
    tools = tools if tools is not None and tools.active else None
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    prompt_text = prompt.text
    request = process_request(state.client, prompt, params, "messages", max_param, req.cache_salt)
    params = request.params
    job = _Job(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model, params.n, params.logprobs, tools,
               parser_for(state.reasoning_parser, params), prompt_text)
    streams = submit(state.client, job.id, [request], req.priority, state.origin(raw, req.model, req.user),
                     state.tenants)
    if req.stream:
        usage = req.stream_options is not None and req.stream_options.include_usage
        return EngineStreamingResponse(_stream(state, job, streams, usage), state.client, streams)

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
        message, reason = _message(c, job)
        choices.append(ChatChoice(index=c.index, message=message, logprobs=_logprobs(state, job, c.token_ids, c.logprobs),
                                  finish_reason=reason))
    body = ChatCompletionResponse(id=job.id, created=job.created, model=model, choices=choices,
                                  usage=usage_of([final]))
    return JSONResponse(body.model_dump())


def _message(c: CompletionOutput, job: _Job) -> tuple[ChatResponseMessage, str | None]:
    """The choice's message (reasoning and tool calls read out of the text) and finish reason."""
    reason = finish_reason(c.finish_reason)
    if not job.parses:
        return ChatResponseMessage(content=c.text), reason
    out = parse_output(c.text, job.tools, job.reasoning_parser, job.prompt_text)
    message = ChatResponseMessage(content=out.content, tool_calls=out.tool_calls or None, reasoning=out.reasoning,
                                  reasoning_content=out.reasoning)
    return message, _call_reason(reason, bool(out.tool_calls))


def _call_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


def _logprobs(state: ServerState, job: _Job, token_ids, entries) -> ChatChoiceLogprobs | None:
    if job.num_logprobs is None:
        return None
    return ChatChoiceLogprobs(content=chat_logprobs(state.texts, token_ids, entries or [], job.num_logprobs))


async def _stream(state: ServerState, job: _Job, streams: list, include_usage: bool) -> AsyncIterator[str]:
    done: set[int] = set()
    final: RequestOutput | None = None
    readers = {i: OutputStream(job.tools, job.reasoning_parser, job.prompt_text) for i in range(job.n)} \
        if job.parses else {}
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
                for choice in _choice_deltas(state, job, c, readers.get(c.index)):
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


def _choice_deltas(state: ServerState, job: _Job, c: CompletionOutput,
                   reader: OutputStream | None) -> list[ChatStreamChoice]:
    """This output's new text as chunks: reasoning, content and tool-call deltas as they come (a
    call's id and name once the name is complete, then its arguments as generated); the finish
    reason on the last; the new tokens' logprobs on the first."""
    if reader is None:
        deltas = [DeltaMessage(content=c.delta_text)] if c.delta_text else []
    else:
        deltas = _deltas(reader.feed(c.delta_text, c.finished))
    if not deltas and not c.finished and not (job.num_logprobs is not None and c.delta_token_ids):
        return []
    if not deltas:
        deltas = [DeltaMessage() if c.finished else DeltaMessage(content="")]
    out = [ChatStreamChoice(index=c.index, delta=d) for d in deltas]
    out[0].logprobs = _logprobs(state, job, c.delta_token_ids, c.delta_logprobs)
    if c.finished:
        out[-1].finish_reason = _call_reason(finish_reason(c.finish_reason), bool(reader and reader.calls))
    return out


def _deltas(events: list) -> list[DeltaMessage]:
    """Events as chunk deltas, consecutive pieces of the same kind merged into one."""
    out: list[DeltaMessage] = []
    last: object = None
    for e in events:
        if isinstance(e, ReasoningDelta):
            if isinstance(last, ReasoningDelta):
                out[-1].reasoning += e.text
                out[-1].reasoning_content += e.text
            else:
                out.append(DeltaMessage(reasoning=e.text, reasoning_content=e.text))
        elif isinstance(e, ContentDelta):
            if isinstance(last, ContentDelta):
                out[-1].content += e.text
            else:
                out.append(DeltaMessage(content=e.text))
        elif isinstance(e, ToolCallStart):
            out.append(DeltaMessage(tool_calls=[{"index": e.index, "id": e.id, "type": "function",
                                                 "function": {"name": e.name, "arguments": ""}}]))
        elif isinstance(last, ToolArgsDelta) and last.index == e.index:
            out[-1].tool_calls[0]["function"]["arguments"] += e.text
        else:
            out.append(DeltaMessage(tool_calls=[{"index": e.index, "function": {"arguments": e.text}}]))
        last = e
    return out
