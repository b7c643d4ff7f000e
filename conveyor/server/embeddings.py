"""POST /v1/embeddings: prompts embedded through the engine (pooled final hidden states)."""

from __future__ import annotations

import base64
import struct
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from conveyor.sampling.params import SamplingParams
from conveyor.server.errors import APIError, bad_request
from conveyor.server.inputs import completion_prompts, off_loop_if_big, process_request, text_chars
from conveyor.server.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, UsageInfo
from conveyor.server.serving import cancel_on_disconnect, collect_finals, submit
from conveyor.server.state import ServerState


async def create_embedding(state: ServerState, req: EmbeddingRequest, raw: Request) -> Response:
    model = state.check_model(req.model)
    if req.dimensions is not None:
        raise bad_request("dimensions is not supported (the embedding has the model's hidden size)", "dimensions")
    prompts = await off_loop_if_big(text_chars(req.input), completion_prompts, state.client, req.input, "input")
    params = SamplingParams(max_tokens=1, pooling=req.pooling)
    requests = [process_request(state.client, p, params, "input") for p in prompts]
    streams = submit(state.client, f"embd-{uuid.uuid4().hex}", requests, 0, state.origin(raw, req.model, req.user),
                     state.tenants)

    finals = await cancel_on_disconnect(raw, collect_finals(state.client, streams))
    data = []
    for i, out in enumerate(finals):
        if out.embedding is None:
            raise APIError(500, "the engine returned no embedding")
        vec = out.embedding
        value = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode() if req.encoding_format == "base64" \
            else vec
        data.append(EmbeddingData(index=i, embedding=value))
    tokens = sum(len(o.prompt_token_ids) for o in finals)
    body = EmbeddingResponse(data=data, model=model, usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens))
    return JSONResponse(body.model_dump())
