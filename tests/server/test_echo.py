"""echo and prompt logprobs over HTTP, as lm-evaluation-harness's loglikelihood requests use
them: echo + logprobs + max_tokens=0 scores a prompt, with the same numbers as the offline
engine's prompt_logprobs; vLLM's prompt_logprobs field; the invalid combinations are 400s."""

from __future__ import annotations

import json
import math

import pytest

from conveyor.engine.engine import Engine, EngineConfig
from conveyor.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

TEXT = "The capital of France is Paris, and the capital of Italy is Rome."


@pytest.fixture(scope="module")
def offline(demo_model):
    engine = Engine(EngineConfig.from_options(num_kv_blocks=64, cost_model="none"), loaded=demo_model)
    rid = engine.add_request(TEXT, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                return out


def test_scoring_request_like_lm_eval(client, model_name, offline):
    r = client.completions.create(model=model_name, prompt=TEXT, echo=True, logprobs=1, max_tokens=0, temperature=0)
    c = r.choices[0]
    assert c.text == TEXT and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(offline.prompt_token_ids)
    lp = c.logprobs
    assert len(lp.tokens) == len(offline.prompt_token_ids) and "".join(lp.tokens).replace("Ġ", " ") == TEXT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [e[t] for e, t in zip(offline.prompt_logprobs[1:], offline.prompt_token_ids[1:])]
    assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(lp.token_logprobs[1:], want))
    # lm-eval's is_greedy: the continuation token is the top alternative
    assert all(len(top) >= 1 for top in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)


def test_echo_with_a_completion(client, model_name):
    r = client.completions.create(model=model_name, prompt="One, two, three,", echo=True, logprobs=0, max_tokens=4,
                                  temperature=0, extra_body={"ignore_eos": True})
    c = r.choices[0]
    plain = client.completions.create(model=model_name, prompt="One, two, three,", max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    assert c.text == "One, two, three," + plain
    assert len(c.logprobs.tokens) == r.usage.prompt_tokens + 4 and c.logprobs.token_logprobs[0] is None


def test_vllm_prompt_logprobs_field(server, model_name, offline):
    r = server.http.post("/v1/completions", json={"model": model_name, "prompt": TEXT, "max_tokens": 1,
                                                  "prompt_logprobs": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(offline.prompt_token_ids)
    tid = str(offline.prompt_token_ids[1])
    assert math.isclose(plp[1][tid]["logprob"], offline.prompt_logprobs[1][int(tid)], abs_tol=1e-5)
    assert all(sum(1 for v in e.values() if v["rank"] is not None) == 2 for e in plp[1:])
    streamed = [json.loads(line[6:]) for line in server.http.post(
        "/v1/completions", json={"model": model_name, "prompt": TEXT, "max_tokens": 3, "prompt_logprobs": 2,
                                 "temperature": 0, "stream": True}).text.splitlines()
        if line.startswith("data: {")]
    assert streamed[0]["choices"][0]["prompt_logprobs"] == plp            # on the first chunk only
    assert all("prompt_logprobs" not in c["choices"][0] for c in streamed[1:])
    plain = server.http.post("/v1/completions", json={"model": model_name, "prompt": "x", "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain["choices"][0]


@pytest.mark.parametrize("body,param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"prompt_logprobs": 99}, "prompt_logprobs"),
])
def test_invalid_echo_combinations(server, model_name, body, param):
    r = server.http.post("/v1/completions", json={"model": model_name, "prompt": "hi", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("max_tokens", [0, 6])
def test_echo_streams_the_prompt_first(server, model_name, max_tokens):
    """Streamed echo: each choice's first chunk starts with its prompt (and the prompt's logprobs);
    the chunks add up to the non-streamed answer, for two prompts at once and for scoring only."""
    body = {"model": model_name, "prompt": ["The capital of France is", "One, two,"], "max_tokens": max_tokens,
            "echo": True, "logprobs": 1, "temperature": 0}
    whole = server.http.post("/v1/completions", json=body).json()["choices"]
    text: dict[int, str] = {}
    tokens: dict[int, list] = {}
    lps: dict[int, list] = {}
    with server.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                if c["index"] not in text:
                    assert c["text"].startswith(body["prompt"][c["index"]])   # the prompt comes first
                text[c["index"]] = text.get(c["index"], "") + c["text"]
                tokens.setdefault(c["index"], []).extend(c["logprobs"]["tokens"])
                lps.setdefault(c["index"], []).extend(c["logprobs"]["token_logprobs"])
    for c in whole:
        assert text[c["index"]] == c["text"]
        assert tokens[c["index"]] == c["logprobs"]["tokens"]
        assert lps[c["index"]][0] is None and lps[c["index"]] == pytest.approx(c["logprobs"]["token_logprobs"])
