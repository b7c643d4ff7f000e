"""Embeddings: /v1/embeddings with the openai SDK (float and base64) equals LLM.embed offline; the
demo model ranks a paraphrase above an unrelated sentence; embedding requests batch with
generation and leave it unchanged; mean pooling computes every token, last pooling may hit the
prefix cache."""

from __future__ import annotations

import math

import pytest

from conveyor.engine.llm import LLM
from conveyor.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

A = "The cat sat quietly on the warm windowsill."
PARAPHRASE = "A cat was sitting calmly on the sunny window ledge."
UNRELATED = "Quarterly tax filings are due at the end of the fiscal year."


def cos(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", num_kv_blocks=128, cost_model="none")


def test_http_embeddings_equal_offline(client, model_name, llm):
    offline = [o.embedding for o in llm.embed([A, UNRELATED])]
    assert all(math.isclose(sum(x * x for x in v), 1.0, rel_tol=1e-4) for v in offline)
    r = client.embeddings.create(model=model_name, input=[A, UNRELATED], encoding_format="float")
    assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens > 0
    for d, want in zip(r.data, offline):
        assert len(d.embedding) == 576 and max(abs(x - y) for x, y in zip(d.embedding, want)) < 1e-4
    b64 = client.embeddings.create(model=model_name, input=A)   # the SDK's default: base64, decoded by it
    assert max(abs(x - y) for x, y in zip(b64.data[0].embedding, offline[0])) < 1e-4


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_paraphrase_ranks_above_unrelated(llm, pooling):
    a, p, u = (o.embedding for o in llm.embed([A, PARAPHRASE, UNRELATED], pooling=pooling))
    assert cos(a, p) > cos(a, u)


def test_embeddings_batch_with_generation(llm):
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    alone = llm.generate(["Once upon a time"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(["Once upon a time", A, PARAPHRASE],
                         [greedy, SamplingParams(pooling="mean"), SamplingParams(pooling="last")], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    alone_vec = llm.embed(A)[0].embedding   # batch shape changes fp32 rounding only
    assert max(abs(x - y) for x, y in zip(mixed[1].embedding, alone_vec)) < 1e-5
    assert mixed[1].outputs[0].token_ids == []
    assert mixed[2].embedding is not None and mixed[2].outputs[0].finish_reason == "stop"


def test_pooling_and_the_prefix_cache(llm):
    text = "A long shared preamble for caching purposes. " * 6
    hits = llm.stats().prefix_cache_hits
    first = llm.embed(text, pooling="mean")[0].embedding
    again = llm.embed(text, pooling="mean")[0].embedding
    assert max(abs(x - y) for x, y in zip(again, first)) < 1e-5 and llm.stats().prefix_cache_hits == hits
    last = llm.embed(text, pooling="last")[0].embedding
    assert llm.stats().prefix_cache_hits > hits   # the last token's state only: the prefix can come from cache
    assert max(abs(x - y) for x, y in zip(last, first)) > 1e-3


def test_bad_embedding_requests(server, model_name):
    for body, param in (({"input": "x", "dimensions": 8}, "dimensions"), ({"input": "x", "pooling": "max"}, "pooling"),
                        ({"input": []}, "prompt"), ({"input": "x", "encoding_format": "int8"}, "encoding_format")):
        r = server.http.post("/v1/embeddings", json={"model": model_name, **body})
        assert r.status_code == 400, r.text
