"""The FastAPI app: OpenAI-compatible routes, tokenizer routes, health and metrics."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from conveyor.frontend.client import EngineClient
from conveyor.core.stats import EngineStats
from conveyor.server import observe, openapi
from conveyor.server.anthropic import register_anthropic_routes
from conveyor.server.chat import create_chat_completion
from conveyor.server.completions import create_completion
from conveyor.server.config import ServerConfig
from conveyor.server.embeddings import create_embedding
from conveyor.server.responses import ResponseStore, register_responses
from conveyor.server.scoring import register_scoring_routes
from conveyor.server.shutdown import Drain
from conveyor.server.errors import APIError, InternalErrorMiddleware, bad_request, install_error_handlers
from conveyor.server.inputs import chat_prompt, encode, off_loop_if_big, text_chars
from conveyor.server.loras import LoRARegistry, parse_lora_modules, register_lora_routes, runtime_updates_allowed
from conveyor.server.metrics import ServerMetrics, log_stats
from conveyor.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from conveyor.server.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                      CompletionResponse, DetokenizeRequest, DetokenizeResponse, EmbeddingRequest,
                                      EmbeddingResponse, HealthStatus, ModelCard, ModelList, ReplicaUp,
                                      TokenizeRequest, TokenizeResponse)
from conveyor.server.state import ServerState
from conveyor.server.tenants import Tenants


def build_app(client: EngineClient, config: ServerConfig | None = None, *, tracer_provider: Any = None,
              **options: Any) -> FastAPI:
    """An app serving `client` as `config` says (server/config.py; `options`: keyword overrides of its
    fields, e.g. ``log_interval=0``); on lifespan shutdown it shuts the engine down too.
    `tracer_provider`: an OpenTelemetry TracerProvider that gets one span per engine request. Fields that
    only the command line acts on (host, port, the engine's process and replicas) are ignored here."""
    if "served_model_names" in options:   # the keyword's name before ServerConfig (Ray Serve app_options)
        options["served_model_name"] = options.pop("served_model_names")
    config = (config or ServerConfig()).replace(**options)
    names = list(config.served_model_name or [client.model_name])
    metrics = ServerMetrics(lambda: replica_states(client), names[0])
    tenants = Tenants(config.api_keys, config.tenant_max_requests, config.tenant_metrics_max, metrics.registry,
                      names[0])
    loras = LoRARegistry(names)
    for name, path in parse_lora_modules(config.lora_modules):
        try:
            loras.add(name, path)
        except APIError as e:
            raise ValueError(f"--lora-modules {name}={path}: {e.message}") from None
    state = ServerState(client, names, metrics, config.tool_call_parser, config.reasoning_parser, tenants, loras)
    replicas = getattr(client, "replicas", None)   # data parallel: each replica's requests under its index
    if isinstance(replicas, list) and all(hasattr(r, "add_finished_listener") for r in replicas):
        for r, listener in zip(replicas, state.metrics.finished_listeners(len(replicas))):
            r.add_finished_listener(listener)
            r.add_finished_listener(tenants.finished)
    else:
        client.add_finished_listener(state.metrics.observe_finished)
        client.add_finished_listener(tenants.finished)

    # The one shutdown (server/shutdown.py): started by a signal, or here at the lifespan's end.
    drain = Drain(client, config.shutdown_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        logger_task = (asyncio.create_task(log_stats(client.stats, config.log_interval))
                       if config.log_interval > 0 else None)
        try:
            yield
        finally:
            if logger_task is not None:
                logger_task.cancel()
            await drain.wait()

    app = FastAPI(title="Conveyor", summary="OpenAI-compatible LLM server", lifespan=lifespan)
    app.state.conveyor = state
    app.state.drain = drain
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_keys)
    app.add_middleware(InternalErrorMiddleware)
    if config.logs_requests or tracer_provider is not None:
        observe.install(app, client, names[0], config.logs_requests, config.log_request_text, tracer_provider)
    if config.allowed_origins:   # browsers' preflight OPTIONS answered before the API key check (added last = runs first)
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=["*"],
                           allow_headers=["*"])

    @app.post("/v1/completions",
              responses=openapi.responses(openapi.ENGINE, CompletionResponse, streams=True))
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await create_completion(state, body, raw)

    @app.post("/v1/chat/completions",
              responses=openapi.responses(openapi.ENGINE, ChatCompletionResponse, streams=True))
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(state, body, raw)

    register_responses(app, state, ResponseStore(config.responses_max_stored, config.responses_max_stored_bytes))

    register_anthropic_routes(app, state)

    @app.post("/v1/embeddings", responses=openapi.responses(openapi.ENGINE, EmbeddingResponse))
    async def embeddings(body: EmbeddingRequest, raw: Request) -> Response:
        return await create_embedding(state, body, raw)

    register_scoring_routes(app, state)

    if runtime_updates_allowed(config.allow_runtime_lora_updating):
        register_lora_routes(app, loras)

    @app.get("/v1/models", responses=openapi.responses(openapi.ANY))
    async def models() -> ModelList:
        return ModelList(data=[_card(state, n) for n in [*names, *loras.adapters]])

    @app.get("/v1/models/{model:path}", responses=openapi.responses(openapi.LOOKUP))
    async def model(model: str) -> ModelCard:
        return _card(state, state.check_model(model))

    replicated = getattr(client, "replica_health", None) is not None   # data parallel: /health names replicas

    @app.get("/health", response_class=Response, response_description=openapi.HEALTHY,
             responses=openapi.responses(openapi.HEALTH, HealthStatus if replicated else None))
    async def health() -> Response:
        if client.is_healthy:
            if not replicated:
                return Response(status_code=200)
            up = client.replica_health()   # serving while any replica is up; say which are down
            replicas = [ReplicaUp(replica=i, up=u) for i, u in enumerate(up)]
            return JSONResponse(HealthStatus(status="ok" if all(up) else "degraded", replicas=replicas).model_dump())
        reason = client.dead_reason
        return APIError(503, "the engine is not running" + (f": {reason}" if reason else " (shutting down)"),
                        code="unavailable").response()

    @app.get("/metrics", response_class=Response, responses=openapi.responses(openapi.OPEN, text="text/plain"))
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize", responses=openapi.responses(openapi.BODY))
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        chars = text_chars(body.messages, body.prompt)
        if body.messages is not None:
            ids = (await off_loop_if_big(chars, chat_prompt, client, body.messages, body.add_generation_prompt)).token_ids
        else:
            ids = await off_loop_if_big(chars, encode, client, body.prompt, "prompt", body.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=client.max_model_len, tokens=ids)

    @app.get("/tokenizer_info", responses=openapi.responses(openapi.ANY))
    async def tokenizer_info() -> dict:
        """What a remote-tokenizer client needs (lm-evaluation-harness's `tokenizer_backend=remote`,
        as vLLM serves it): special tokens, the chat template, the context length."""
        tok = client.tokenizer
        return {"tokenizer_class": "PreTrainedTokenizerFast", **tok.special_tokens,
                "chat_template": tok.chat_template, "model_max_length": client.max_model_len,
                "add_bos_token": tok.add_bos_token, "vocab_size": tok.vocab_size}

    @app.post("/detokenize", responses=openapi.responses(openapi.BODY))
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        state.check_model(body.model)
        vocab = client.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise bad_request(f"token ids must be in [0, {vocab})", "tokens")
        return DetokenizeResponse(prompt=client.tokenizer.decode(body.tokens))

    return app


def replica_states(client: EngineClient) -> list[tuple[EngineStats, bool]]:
    """(stats, serving) per engine replica: one for a single engine, N under data parallelism."""
    per_replica = getattr(client, "replica_stats", None)
    if per_replica is None:
        return [(client.stats(), client.is_healthy)]
    return list(zip(per_replica(), client.replica_health()))


def _card(state: ServerState, name: str) -> ModelCard:
    lora = state.loras.get(name) if state.loras is not None else None
    if lora is not None:   # as vLLM lists an adapter: its path as root, the base model as parent
        return ModelCard(id=name, root=lora.lora_path, parent=state.model_name,
                         max_model_len=state.client.max_model_len)
    return ModelCard(id=name, root=state.client.model_name, max_model_len=state.client.max_model_len)
