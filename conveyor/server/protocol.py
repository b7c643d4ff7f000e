"""Request and response bodies of the OpenAI-compatible API (pydantic), plus a few extensions."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer


class _Body(BaseModel):
    # A field this server does not know is a 400 naming it: vLLM's guided_json, OpenAI's
    # response_format, ... silently ignored would make a client believe a constraint held.
    # Fields that cannot change the output (user, metadata, store, service_tier) are declared
    # and ignored; declared-but-unsupported ones are rejected with their own message.
    model_config = ConfigDict(extra="forbid")


# ---- requests -------------------------------------------------------------------------------

class StreamOptions(_Body):
    include_usage: bool = False
    include_obfuscation: bool | None = None   # padding against side channels: none is sent either way


class SamplingFields(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions (vLLM names for extensions)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None     # OpenAI bookkeeping fields: no effect on the output
    store: bool | None = None
    service_tier: str | None = None
    priority: int = 0                      # extension: lower runs first
    max_queue_time: float | None = None    # extension: seconds it may wait for its first scheduling (else a 503)
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    allowed_token_ids: list[int] | None = None   # vLLM extensions
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    # vLLM: prefix-cache blocks are shared only among requests with the same salt (a non-empty string).
    cache_salt: str | None = Field(default=None, min_length=1)
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    prompt_logprobs: int | None = None     # vLLM: the prompt tokens' logprobs, in choices[i].prompt_logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")   # name, tool_call_id, ... reach the template as given
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True     # extension, as in vLLM
    continue_final_message: bool = False   # vLLM: continue the last (assistant) message instead of a new turn
    chat_template: str | None = None       # vLLM: a Jinja template for this request
    chat_template_kwargs: dict[str, Any] | None = None   # vLLM: extra template variables
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class EmbeddingRequest(_Body):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    pooling: Literal["mean", "last"] = "mean"   # extension: how the final hidden states are pooled


class ResponsesRequest(_Body):
    """POST /v1/responses (conveyor/server/responses.py)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None   # include_obfuscation: no padding is sent either way
    text: dict[str, Any] | None = None       # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    tools: list[dict[str, Any]] | None = None   # function tools, Responses' flat shape
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    include: list[str] | None = None          # none supported: only [] is accepted
    store: bool | None = None                 # None: true, as in OpenAI
    previous_response_id: str | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None   # {"effort", "summary"}: echoed, not applied
    truncation: Literal["disabled"] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None       # OpenAI's cache routing hint: no effect here
    safety_identifier: str | None = None
    # extensions, as on chat completions
    cache_salt: str | None = Field(default=None, min_length=1)
    top_k: int | None = None
    ignore_eos: bool = False
    priority: int = 0


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


# ---- responses ------------------------------------------------------------------------------

def _now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's shape: None for the first token, then {token id: {"logprob", "rank", "decoded_token"}}
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None

    @model_serializer(mode="wrap")
    def _drop_prompt_logprobs(self, handler: Any) -> dict[str, Any]:
        d = handler(self)
        if d.get("prompt_logprobs") is None:
            d.pop("prompt_logprobs", None)
        return d


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    # --reasoning-parser: the <think> text, under vLLM's current name and its older one (SGLang,
    # DeepSeek's API); both absent when the server has no reasoning parser.
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_reasoning(self, handler: Any) -> dict[str, Any]:
        d = handler(self)
        if d.get("reasoning") is None:
            d.pop("reasoning", None)
            d.pop("reasoning_content", None)
        return d


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        # A delta carries only what changed: {"role": ...} first, then {"content": ...}, then {}.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: UsageInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "conveyor"
    root: str | None = None
    parent: str | None = None   # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ReplicaUp(BaseModel):
    replica: int
    up: bool


class HealthStatus(BaseModel):
    """/health's body under data parallelism (a single engine answers an empty 200)."""
    status: Literal["ok", "degraded"]
    replicas: list[ReplicaUp]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
