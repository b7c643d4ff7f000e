"""/v1/score and /v1/rerank on the generative demo model (sigmoid of the query's pointwise mutual
information with the document, from prompt logprobs): a paraphrase or an answer ranks above
unrelated passages, top_n and return_documents are honoured, both /v1/score shapes, the 400s,
and every KV block is free afterwards."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.slow

# (query, [a paraphrase of it or a passage answering it, unrelated passages...])
SETS = [
    ("Where did the cat sit?", ["The cat was sitting on the warm windowsill.",
                                "Quarterly tax filings are due at the end of the fiscal year.",
                                "The stock market fell sharply on Monday."]),
    ("What is the capital of France?", ["Which city is the capital of France?",
                                        "Photosynthesis converts light into chemical energy in plants.",
                                        "Reranking is fun!"]),
    ("How do plants make food?", ["Plants use photosynthesis to turn sunlight, water and carbon dioxide into sugar.",
                                  "The train to Berlin leaves at noon.",
                                  "Paris is the capital of France."]),
    ("Who wrote Hamlet?", ["Hamlet is a tragedy written by William Shakespeare.",
                           "The weather will be sunny tomorrow.",
                           "Python is a programming language."]),
]


def post(server, path: str, body: dict):
    return server.http.post(path, json=body)


@pytest.mark.parametrize("query,docs", SETS, ids=[q for q, _ in SETS])
def test_rerank_puts_the_related_passage_first(server, query, docs):
    shuffled = [docs[1], docs[0], docs[2]]   # the related one at index 1
    r = post(server, "/v1/rerank", {"query": query, "documents": shuffled})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] and body["model"] == server.engine.model_name and body["usage"]["total_tokens"] > 0
    results = body["results"]
    assert [x["index"] for x in results][0] == 1
    assert sorted(x["index"] for x in results) == [0, 1, 2]
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True) and all(0 < s < 1 for s in scores)
    assert all(x["document"]["text"] == shuffled[x["index"]] for x in results)


def test_top_n_and_return_documents(server):
    query, docs = SETS[0]
    full = post(server, "/v1/rerank", {"query": query, "documents": docs}).json()["results"]
    r = post(server, "/v2/rerank", {"query": query, "documents": [{"text": d} for d in docs], "top_n": 2,
                                    "return_documents": False})
    assert r.status_code == 200, r.text
    top = r.json()["results"]
    assert [x["index"] for x in top] == [x["index"] for x in full[:2]]
    assert all("document" not in x for x in top)
    for a, b in zip(top, full):   # the same computation whatever the route and document form
        assert math.isclose(a["relevance_score"], b["relevance_score"], abs_tol=1e-6)


def test_score_shapes_agree_with_rerank(server):
    query, docs = SETS[1]
    one_vs_list = post(server, "/v1/score", {"text_1": query, "text_2": docs})
    assert one_vs_list.status_code == 200, one_vs_list.text
    body = one_vs_list.json()
    assert body["object"] == "list" and body["usage"]["prompt_tokens"] > 0
    assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "score"), (1, "score"), (2, "score")]
    scores = [d["score"] for d in body["data"]]
    assert scores[0] == max(scores)
    rerank = {x["index"]: x["relevance_score"]
              for x in post(server, "/v1/rerank", {"query": query, "documents": docs}).json()["results"]}
    assert all(math.isclose(scores[i], rerank[i], abs_tol=1e-6) for i in range(3))

    # list vs list: pairwise; each pair scores as it does alone
    queries = [q for q, _ in SETS[:3]]
    answers = [d[0] for _, d in SETS[:3]]
    pairs = post(server, "/score", {"text_1": queries, "text_2": answers}).json()["data"]
    assert [d["index"] for d in pairs] == [0, 1, 2]
    assert math.isclose(pairs[1]["score"], scores[0], abs_tol=1e-6)
    swapped = post(server, "/v1/score", {"text_1": queries, "text_2": answers[1:] + answers[:1]}).json()["data"]
    assert sum(d["score"] for d in pairs) > sum(d["score"] for d in swapped)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/rerank", {"query": "q?", "documents": []}, "documents"),
    ("/v1/rerank", {"query": " ", "documents": ["a"]}, "query"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["x", "y", "z"]}, "text_2"),
    ("/v1/score", {"text_1": [], "text_2": "x"}, "text_1"),
    ("/v1/rerank", {"query": "q?", "documents": ["a"], "rank_fields": ["x"]}, "rank_fields"),
    ("/v1/rerank", {"query": "a question", "documents": ["a"], "truncate_prompt_tokens": 2},
     "truncate_prompt_tokens"),
])
def test_bad_requests_are_400s(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_unknown_model_is_404(server):
    r = post(server, "/v1/rerank", {"model": "nope", "query": "q?", "documents": ["a"]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_every_block_is_free_afterwards(server):
    query, docs = SETS[2]
    assert post(server, "/v1/rerank", {"query": query, "documents": docs * 4}).status_code == 200
    stats = server.wait_idle()
    assert stats.kv_usage == 0.0 and stats.num_free_kv_blocks == stats.num_kv_blocks
    assert stats.kv_invariant_violations == 0


def test_a_document_scored_again_comes_from_the_prefix_cache(server):
    """Scoring reads only the query's logprobs, so the document before it is read from the prefix
    cache once another request computed it; the scores do not change."""
    doc = " ".join(d[0] for _, d in SETS) * 3   # several KV blocks long
    queries = [q for q, _ in SETS]
    first = post(server, "/v1/score", {"text_1": queries, "text_2": doc})
    assert first.status_code == 200, first.text
    hits = server.wait_idle().prefix_cache_hits
    again = post(server, "/v1/score", {"text_1": queries, "text_2": doc})
    stats = server.wait_idle()
    blocks = len(doc) // 8 // stats.block_size   # at least this many of the document's blocks, per pair
    assert stats.prefix_cache_hits - hits >= len(queries) * blocks > 0
    for a, b in zip(first.json()["data"], again.json()["data"]):
        assert math.isclose(a["score"], b["score"], abs_tol=1e-3)
