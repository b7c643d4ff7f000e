"""POST /v1/score and /v1/rerank (vLLM's and Jina/Cohere's shapes) for a generative model.

A generative LM has no relevance head, so the score of (query, document) is read from its
prompt logprobs: the mean log-probability of the query's tokens after the document,

    cond = mean log p(query | "Document: {doc}\\nQuestion:")

minus the mean log-probability of the same tokens after the same template without a document,

    prior = mean log p(query | "Document: \\nQuestion:")

(pointwise mutual information per token: how much the document makes this query more likely,
whatever the query's own prior; docs/server.md says what else was tried), and
``score = sigmoid(cond - prior)``: above 0.5 the document helps predict the query, about 0.5 it
says nothing about it. The query's token ids are the same in both prompts (tokenized once,
appended to the tokenized prefix), so the two means are over the very same tokens. One engine
request per pair plus one per distinct query, all submitted together (they batch); each asks for
the logprobs of its query's tokens only (``prompt_logprobs_last``), so the document and template
before them come from the prefix cache when another request computed them.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from conveyor.frontend.outputs import RequestOutput
from conveyor.sampling.params import SamplingParams
from conveyor.server import openapi
from conveyor.server.errors import APIError, bad_request
from conveyor.frontend.inputs import ProcessedRequest
from conveyor.server.inputs import Prompt, check_text_size, encode, off_loop_if_big, process_request, text_chars
from conveyor.server.protocol import UsageInfo, _Body
from conveyor.server.serving import cancel_on_disconnect, collect_finals, submit
from conveyor.server.state import ServerState

WITH_DOCUMENT = "Document: {document}\nQuestion:"
WITHOUT_DOCUMENT = WITH_DOCUMENT.format(document="")


# ---- bodies -----------------------------------------------------------------------------------

class ScoreRequest(_Body):
    model: str | None = None
    text_1: str | list[str]     # the queries
    text_2: str | list[str]     # the documents
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    priority: int = 0
    user: str | None = None


class RerankDocument(BaseModel):
    text: str


class RerankRequest(_Body):
    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(default=None, ge=0)   # None or 0: all
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    priority: int = 0
    user: str | None = None


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: UsageInfo


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


# ---- scoring ----------------------------------------------------------------------------------

def pair_prompts(state: ServerState, queries: list[str], documents: list[str], params: SamplingParams,
                 names: tuple[str, str]) -> tuple[list[ProcessedRequest], list[int], list[int]]:
    """Engine prompts: one per distinct query (its prior), then one per (query, document) pair.
    Also each prompt's number of query tokens (the scored tail) and each pair's prior prompt.
    `names`: the request's fields for the queries and the documents (for the 400s)."""
    client, (query_param, doc_param) = state.client, names
    prompts, counts, prior_of = [], [], {}
    query_ids: dict[str, list[int]] = {}
    for q in queries:
        if q in query_ids:
            continue
        if not q.strip():
            raise bad_request("a query must not be empty", query_param)
        check_text_size(client, len(q), query_param)
        query_ids[q] = encode(client, " " + q, query_param, add_special_tokens=False)
        prior_of[q] = len(prompts)
        prompts.append(Prompt(None, encode(client, WITHOUT_DOCUMENT, query_param) + query_ids[q]))
        counts.append(len(query_ids[q]))
    for q, d in zip(queries, documents):
        check_text_size(client, len(d), doc_param)
        prefix = encode(client, WITH_DOCUMENT.format(document=d), doc_param)
        prompts.append(Prompt(None, prefix + query_ids[q]))
        counts.append(len(query_ids[q]))
    # only the query's logprobs are read: the document before it may come from the prefix cache
    requests = [process_request(client, p, dataclasses.replace(params, prompt_logprobs_last=n), doc_param)
                for p, n in zip(prompts, counts)]
    for r, n in zip(requests, counts):
        if n >= len(r.prompt_token_ids):   # truncate_prompt_tokens cut into the query
            raise bad_request(f"truncate_prompt_tokens leaves {len(r.prompt_token_ids)} tokens, but the query alone "
                              f"has {n} (and needs one before it)", "truncate_prompt_tokens")
    return requests, counts, [prior_of[q] for q in queries]


def mean_logprob(out: RequestOutput, n: int) -> float:
    """The mean log-probability of the prompt's last n tokens."""
    ids, lps = out.prompt_token_ids, out.prompt_logprobs
    if lps is None or len(lps) != len(ids):
        raise APIError(500, "the engine returned no prompt logprobs")
    return sum(float(lps[i][ids[i]]) for i in range(len(ids) - n, len(ids))) / n


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


async def score_pairs(state: ServerState, raw: Request, queries: list[str], documents: list[str],
                      truncate: int | None, priority: int, names: tuple[str, str],
                      model: str | None = None, user: str | None = None) -> tuple[list[float], int]:
    """sigmoid(PMI) per (query, document) pair, and the prompt tokens it took."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, truncate_prompt_tokens=truncate)
    chars = text_chars(queries, documents)
    requests, counts, prior_of = await off_loop_if_big(chars, pair_prompts, state, queries, documents, params, names)
    streams = submit(state.client, f"score-{uuid.uuid4().hex}", requests, priority, state.origin(raw, model, user),
                     state.tenants)
    finals = await cancel_on_disconnect(raw, collect_finals(state.client, streams))
    means = [mean_logprob(out, n) for out, n in zip(finals, counts)]
    pairs = means[len(means) - len(queries):]
    scores = [sigmoid(cond - means[prior]) for cond, prior in zip(pairs, prior_of)]
    return scores, sum(len(o.prompt_token_ids) for o in finals)


def _texts(value: str | list[str], param: str) -> list[str]:
    texts = [value] if isinstance(value, str) else list(value)
    if not texts:
        raise bad_request(f"{param} must not be empty", param)
    return texts


async def create_score(state: ServerState, req: ScoreRequest, raw: Request) -> Response:
    model = state.check_model(req.model)
    queries, documents = _texts(req.text_1, "text_1"), _texts(req.text_2, "text_2")
    if len(queries) == 1:
        queries = queries * len(documents)
    elif len(documents) == 1:
        documents = documents * len(queries)
    elif len(queries) != len(documents):
        raise bad_request(f"text_1 and text_2 must have the same length (or one of them a single text), got "
                          f"{len(queries)} and {len(documents)}", "text_2")
    scores, tokens = await score_pairs(state, raw, queries, documents, req.truncate_prompt_tokens, req.priority,
                                       ("text_1", "text_2"), req.model, req.user)
    body = ScoreResponse(id=f"score-{uuid.uuid4().hex}", model=model,
                         data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                         usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens))
    return JSONResponse(body.model_dump())


async def create_rerank(state: ServerState, req: RerankRequest, raw: Request) -> Response:
    model = state.check_model(req.model)
    if not req.documents:
        raise bad_request("documents must not be empty", "documents")
    docs = [d if isinstance(d, str) else d.text for d in req.documents]
    scores, tokens = await score_pairs(state, raw, [req.query] * len(docs), docs, req.truncate_prompt_tokens,
                                       req.priority, ("query", "documents"), req.model, req.user)
    order = sorted(range(len(docs)), key=lambda i: -scores[i])[:req.top_n or None]
    results = [RerankResult(index=i, relevance_score=scores[i],
                            document=RerankDocument(text=docs[i]) if req.return_documents else None)
               for i in order]
    body = RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=model, usage=RerankUsage(total_tokens=tokens),
                          results=results)
    return JSONResponse(body.model_dump(exclude_none=True))


def register_scoring_routes(app: FastAPI, state: ServerState) -> None:
    scored = openapi.responses(openapi.ENGINE, ScoreResponse)
    reranked = openapi.responses(openapi.ENGINE, RerankResponse)

    @app.post("/score", responses=scored)
    @app.post("/v1/score", responses=scored)
    async def score(body: ScoreRequest, raw: Request) -> Response:
        return await create_score(state, body, raw)

    @app.post("/rerank", responses=reranked)
    @app.post("/v1/rerank", responses=reranked)
    @app.post("/v2/rerank", responses=reranked)
    async def rerank(body: RerankRequest, raw: Request) -> Response:
        return await create_rerank(state, body, raw)
