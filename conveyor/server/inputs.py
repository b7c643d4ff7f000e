"""Turn an API request into engine inputs: token ids per prompt (chat templates rendered here) and
SamplingParams under the API's names; then the engine's one input processor (frontend/inputs.py) makes
each a ProcessedRequest."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from conveyor.frontend.client import EngineClient
from conveyor.frontend.inputs import ApiNames, ProcessedRequest, Prompt
from conveyor.sampling.params import SamplingParams
from conveyor.sampling.structured import KINDS as STRUCTURED_KINDS, StructuredOutputsParams
from conveyor.server.errors import bad_request, invalid_request
from conveyor.server.tools import ToolPlan, render_messages, strict_objects
from conveyor.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields

MAX_N = 16
T = TypeVar("T")


# ---- prompts --------------------------------------------------------------------------------

# Inputs with more characters than this are tokenized in a worker thread, off the event loop.
OFF_LOOP_CHARS = 20_000


def text_chars(*values: object) -> int:
    """Characters of text in a request's prompts or messages (strings nested in lists, dicts, models)."""
    total, stack = 0, list(values)
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, ChatMessage):
            stack.append(v.model_dump(exclude_none=True))
    return total


async def off_loop_if_big(chars: int, fn: Callable[..., T], *args: object) -> T:
    """fn(*args), in a worker thread when the input is big (tokenizing 1 MB takes ~0.5 s)."""
    if chars > OFF_LOOP_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def check_text_size(client: EngineClient, chars: int, param: str) -> None:
    """Reject a text that cannot fit the context whatever its tokens, before tokenizing it (frontend/inputs.py)."""
    try:
        client.inputs.check_text_size(chars, param)
    except ValueError as e:
        raise invalid_request(e) from e


def encode(client: EngineClient, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    try:
        return client.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except ValueError as e:   # not valid Unicode (a lone surrogate)
        raise bad_request(str(e), param) from e


def completion_prompts(client: EngineClient, prompt: str | list, param: str = "prompt") -> list[Prompt]:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids (`param`: the
    route's name for the field)."""
    if isinstance(prompt, str):
        check_text_size(client, len(prompt), param)
        return [Prompt(prompt, encode(client, prompt, param))]
    if not prompt:
        raise bad_request(f"{param} must not be empty", param)
    if isinstance(prompt[0], int):
        return [Prompt(None, list(prompt))]
    for p in prompt:
        if isinstance(p, str):
            check_text_size(client, len(p), param)
    return [Prompt(p, encode(client, p, param)) if isinstance(p, str) else Prompt(None, list(p)) for p in prompt]


def message_dicts(messages: list[ChatMessage], param: str = "messages") -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"only text content parts are supported, got type {part.get('type')!r}",
                                      f"{param}.{i}.content")
                texts.append(part["text"])
            d["content"] = "".join(texts)
        out.append(d)
    return out


def chat_prompt(client: EngineClient, messages: list[ChatMessage], add_generation_prompt: bool = True,
                tools: ToolPlan | None = None, chat_template: str | None = None,
                continue_final_message: bool = False, template_kwargs: dict | None = None) -> Prompt:
    tok = client.tokenizer
    if continue_final_message:
        if add_generation_prompt:
            raise bad_request("continue_final_message needs add_generation_prompt false", "continue_final_message")
        if messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs an assistant message last", "continue_final_message")
    reserved = set(template_kwargs or ()) & {"messages", "tools", "add_generation_prompt", "chat_template",
                                             "continue_final_message", "tokenize"}
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}", "chat_template_kwargs")
    dicts, template_tools = render_messages(message_dicts(messages), chat_template or tok.chat_template or "", tools)
    try:
        text = tok.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt, tools=template_tools,
                                       chat_template=chat_template, continue_final_message=continue_final_message,
                                       **(template_kwargs or {}))
    except Exception as e:   # noqa: BLE001 - a template raising on these messages is a bad request
        raise bad_request(f"the chat template failed on these messages: {e}", "messages") from e
    check_text_size(client, len(text), "messages")
    return Prompt(text, encode(client, text, "messages", add_special_tokens=False))


# ---- sampling parameters -------------------------------------------------------------------

def check_common(req: SamplingFields) -> None:
    if req.n > MAX_N:
        raise bad_request(f"n must be at most {MAX_N}, got {req.n}", "n")
    if req.best_of is not None and req.best_of > MAX_N:
        raise bad_request(f"best_of must be at most {MAX_N}, got {req.best_of}", "best_of")
    if req.best_of is not None and req.best_of > req.n and req.stream:
        raise bad_request("best_of > n cannot stream (the best are known only at the end)", "best_of")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def sampling_params(req: SamplingFields, max_tokens: int | None, max_tokens_param: str,
                    logprobs: int | None, logprobs_param: str = "logprobs",
                    defaults: dict | None = None) -> SamplingParams:
    """Build SamplingParams; their errors become 400s naming the API parameter (by the error's `param`).
    A field the request omits takes the model's default (`defaults`: conveyor/sampling/defaults.py), else
    the API's; a missing max_tokens stays None here (process_request fills it in)."""
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{max_tokens_param} must be at least 1, got {max_tokens}", max_tokens_param)
    defaults = defaults or {}

    def given(name: str, default):
        value = getattr(req, name)
        return defaults.get(name, default) if value is None else value

    structured = structured_outputs(req)
    try:
        bias = {int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None
    except ValueError as e:
        raise bad_request("logit_bias keys must be token ids", "logit_bias") from e
    try:
        return SamplingParams(
            best_of=req.best_of, logit_bias=bias, allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
            truncate_prompt_tokens=req.truncate_prompt_tokens, structured_outputs=structured, n=req.n,
            temperature=given("temperature", 1.0), top_p=given("top_p", 1.0),
            top_k=given("top_k", 0), min_p=given("min_p", 0.0), seed=req.seed, stop=req.stop,
            stop_token_ids=req.stop_token_ids, presence_penalty=given("presence_penalty", 0.0),
            frequency_penalty=given("frequency_penalty", 0.0),
            repetition_penalty=given("repetition_penalty", 1.0), ignore_eos=req.ignore_eos,
            max_tokens=max_tokens, min_tokens=req.min_tokens, logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output, max_queue_time=req.max_queue_time)
    except ValueError as e:
        raise invalid_request(e, {"max_tokens": max_tokens_param, "logprobs": logprobs_param},
                              type(req).model_fields) from e


def format_constraint(kind: str, schema: object, name: str, schema_where: str, param: str) -> dict | None:
    """An OpenAI output format (text, json_object, json_schema) as StructuredOutputsParams fields
    (None for text); `name`, `schema_where` and `param` word the 400s."""
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        if not isinstance(schema, dict):
            raise bad_request(f"{name} json_schema needs {schema_where} (an object)", param)
        return {"json": schema}
    if kind != "text":
        raise bad_request(f"{name} type must be text, json_object or json_schema, got {kind!r}", param)
    return None


def structured_outputs(req: SamplingFields) -> StructuredOutputsParams | None:
    """The request's output constraint from whichever field gave it (at most one may)."""
    found: list[tuple[str, dict]] = []
    fmt = req.response_format
    if fmt is not None:
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if isinstance(schema, dict) and spec.get("strict") is True:   # OpenAI's strict mode: no unlisted keys
            schema = strict_objects(schema)
        constraint = format_constraint(fmt.get("type", "text"), schema, "response_format", "json_schema.schema",
                                       "response_format")
        if constraint is not None:
            found.append(("response_format", constraint))
    if req.structured_outputs is not None:
        unknown = sorted(set(req.structured_outputs) - set(STRUCTURED_KINDS))
        if unknown:
            raise bad_request(f"unsupported structured_outputs field(s) {', '.join(unknown)}; the supported ones "
                              f"are {', '.join(STRUCTURED_KINDS)}", "structured_outputs")
        found.append(("structured_outputs", dict(req.structured_outputs)))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            found.append((name, {kind: getattr(req, name)}))
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(f"give one output constraint, not {len(found)} ({', '.join(n for n, _ in found)})",
                          found[1][0])
    name, spec = found[0]
    try:
        return StructuredOutputsParams(**spec)
    except ValueError as e:
        raise bad_request(str(e), name) from e


def completion_sampling(req: CompletionRequest, defaults: dict | None = None) -> SamplingParams:
    """The request's SamplingParams; echo with logprobs (and vLLM's prompt_logprobs) ask for the
    prompt's logprobs, and max_tokens=0 with echo scores the prompt only (one token is generated
    and dropped)."""
    check_common(req)
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    max_tokens = req.max_tokens
    if "max_tokens" not in req.model_fields_set and "max_tokens" in (defaults or {}):
        max_tokens = None   # the model's default, capped by the context (process_request), not the API's 16
    if max_tokens == 0:
        if not req.echo:
            raise bad_request("max_tokens must be at least 1 (0 only with echo: scoring the prompt)", "max_tokens")
        max_tokens = 1
    params = sampling_params(req, max_tokens, "max_tokens", req.logprobs, defaults=defaults)
    wanted = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
    if wanted:
        params.prompt_logprobs = max(wanted)
        try:
            params._validate()
        except ValueError as e:
            raise bad_request(str(e), "prompt_logprobs") from e
    return params


def chat_sampling(req: ChatCompletionRequest, tools: ToolPlan | None = None,
                  defaults: dict | None = None) -> SamplingParams:
    check_common(req)
    if tools is not None and tools.constraint is not None:
        if structured_outputs(req) is not None:
            raise bad_request(f"tool_choice {tools.choice!r} constrains the output; it cannot be combined with "
                              "another output constraint", "tool_choice")
        req = req.model_copy(update={"structured_outputs": {"grammar": tools.constraint.grammar}})
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    if req.max_completion_tokens is not None:
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, param = req.max_tokens, "max_tokens"
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return sampling_params(req, max_tokens, param, logprobs, "top_logprobs", defaults)


# ---- context length -------------------------------------------------------------------------

def process_request(client: EngineClient, prompt: Prompt, params: SamplingParams, prompt_param: str,
                    max_tokens_param: str = "max_tokens", cache_salt: str | None = None) -> ProcessedRequest:
    """The engine's input processing (frontend/inputs.py: truncation, the context, every check) under this
    route's parameter names; a refusal is a 400 naming the parameter. A missing max_tokens becomes the
    model's default max_tokens, capped by what the context leaves."""
    try:
        return client.inputs.process(prompt, params, cache_salt=cache_salt,
                                     api=ApiNames(prompt_param, max_tokens_param))
    except ValueError as e:   # a constraint may come from several fields (response_format, guided_*, tools)
        raise invalid_request(e, {"structured_outputs": None}) from e
