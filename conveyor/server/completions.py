"""POST /v1/completions: responses and SSE chunks in the OpenAI legacy completions format."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from conveyor.frontend.outputs import RequestOutput
from conveyor.server.errors import APIError
from conveyor.server.inputs import (completion_prompts, completion_sampling, process_request, off_loop_if_big,
                                   text_chars)
from conveyor.server.logprobs import completion_logprobs
from conveyor.server.protocol import (CompletionChoice, CompletionChunk, CompletionLogprobs, CompletionRequest,
                                      CompletionResponse, UsageInfo)
from conveyor.server.serving import (DONE, EngineStreamingResponse, abort, cancel_on_disconnect, check_output,
                                     collect_finals, Job, finish_reason, merged, sse, sse_error, submit)
from conveyor.server.state import ServerState


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request) -> Response:
    model = state.check_model(req.model)
    params = completion_sampling(req, state.client.generation_defaults)
    prompts = await off_loop_if_big(text_chars(req.prompt), completion_prompts, state.client, req.prompt)
    requests = [process_request(state.client, p, params, "prompt", cache_salt=req.cache_salt) for p in prompts]
    job = Job(f"cmpl-{uuid.uuid4().hex}", int(time.time()), model, params.n, params.logprobs)
    streams = submit(state.client, job.id, requests, req.priority, state.origin(raw, req.model, req.user),
                     state.tenants)
    if req.stream:
        usage = req.stream_options is not None and req.stream_options.include_usage
        return EngineStreamingResponse(_stream(state, job, streams, usage, req.echo, req.max_tokens == 0,
                                               req.prompt_logprobs), state.client, streams)

    finals = await cancel_on_disconnect(raw, collect_finals(state.client, streams))
    if req.max_tokens == 0:   # scoring only: the one token generated to run the prompt is not shown
        for out in finals:
            for c in out.outputs:
                c.text, c.token_ids, c.logprobs = "", [], [] if c.logprobs is not None else None
    body = _response(state, job, finals, req.echo, req.prompt_logprobs)
    return JSONResponse(body.model_dump())


def _response(state: ServerState, job: Job, finals: list[RequestOutput], echo: bool = False,
              prompt_logprobs: int | None = None) -> CompletionResponse:
    choices = []
    for i, out in enumerate(finals):
        prompt_text = _prompt_text(state, out) if echo else ""
        for c in out.outputs:
            lp = None
            if job.num_logprobs is not None:
                offset = 0
                if echo:   # the prompt's tokens first (the first has no logprob), then the completion's
                    lp, offset = completion_logprobs(state.texts, out.prompt_token_ids, out.prompt_logprobs or [],
                                                     job.num_logprobs)
                more, _ = completion_logprobs(state.texts, c.token_ids, c.logprobs or [], job.num_logprobs, offset)
                lp = more if lp is None else _joined(lp, more)
            choices.append(CompletionChoice(
                index=i * job.n + c.index, text=prompt_text + c.text, logprobs=lp,
                finish_reason=finish_reason(c.finish_reason),
                prompt_logprobs=None if prompt_logprobs is None else vllm_prompt_logprobs(out, prompt_logprobs)))
    return CompletionResponse(id=job.id, created=job.created, model=job.model, choices=choices,
                              usage=usage_of(finals))


def vllm_prompt_logprobs(out: RequestOutput, k: int) -> list[dict[str, dict] | None]:
    """vLLM's prompt_logprobs: per prompt token, {id: {logprob, rank, decoded_token}} for the top k and
    the prompt's own token (whose rank is null when it is not among the top k)."""
    result: list[dict[str, dict] | None] = []
    for entry in out.prompt_logprobs or []:
        if entry is None:
            result.append(None)
            continue
        result.append({str(t): {"logprob": lp.logprob, "rank": lp.rank if lp.rank <= k else None,
                                "decoded_token": lp.decoded_token} for t, lp in entry.items()})
    return result


def usage_of(finals: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


async def _stream(state: ServerState, job: Job, streams: list, include_usage: bool, echo: bool = False,
                  score_only: bool = False, prompt_logprobs: int | None = None) -> AsyncIterator[str]:
    """Chunks as tokens come; with echo, each choice's first chunk starts with its prompt (and the
    prompt's logprobs); scoring only (echo, max_tokens 0): the prompt alone, then the finish;
    vLLM's prompt_logprobs ride on each choice's first chunk."""
    offsets: dict[int, int] = {}
    started: set[int] = set()
    done: set[int] = set()
    finals: list[RequestOutput] = []
    try:
        async for i, out in merged(streams):
            check_output(out)
            for c in out.outputs:
                index = i * job.n + c.index
                first = index not in started
                if score_only:   # the one token generated to run the prompt is not shown, nor counted
                    if not c.finished:
                        continue
                    c.text, c.token_ids, c.delta_text, c.delta_token_ids = "", [], "", ()
                    c.logprobs, c.delta_logprobs = ([], ()) if c.logprobs is not None else (None, None)
                if index in done or not ((first and (echo or prompt_logprobs is not None)) or c.delta_text or c.finished
                                         or (job.num_logprobs is not None and c.delta_token_ids)):
                    continue
                if c.finished:
                    done.add(index)
                started.add(index)
                text, lp = c.delta_text, None
                if first and echo:
                    text = _prompt_text(state, out) + text
                    offsets[index] = 0
                    if job.num_logprobs is not None:
                        lp, offsets[index] = completion_logprobs(state.texts, out.prompt_token_ids,
                                                                 out.prompt_logprobs or [], job.num_logprobs)
                if job.num_logprobs is not None:
                    more, offsets[index] = completion_logprobs(state.texts, c.delta_token_ids, c.delta_logprobs or (),
                                                               job.num_logprobs, offsets.get(index, 0))
                    lp = more if lp is None else _joined(lp, more)
                choice = CompletionChoice(index=index, text=text, logprobs=lp,
                                          finish_reason=finish_reason(c.finish_reason))
                if first and prompt_logprobs is not None:
                    choice.prompt_logprobs = vllm_prompt_logprobs(out, prompt_logprobs)
                yield sse(CompletionChunk(id=job.id, created=job.created, model=job.model, choices=[choice]))
            if out.finished:
                finals.append(out)
        if include_usage:
            yield sse(CompletionChunk(id=job.id, created=job.created, model=job.model, choices=[],
                                      usage=usage_of(finals)))
    except APIError as e:
        yield sse_error(e)
    finally:
        abort(state.client, streams)
    yield DONE


def _prompt_text(state: ServerState, out: RequestOutput) -> str:
    return out.prompt if out.prompt is not None else state.client.tokenizer.decode(out.prompt_token_ids,
                                                                                  skip_special_tokens=False)


def _joined(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(a, name).extend(getattr(b, name))
    return a
