"""Bad requests get an OpenAI-style error body with the right 4xx status; the server keeps serving."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

OK = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}


def _error(r, status: int, param: str | None = "<any>", code: str | None = "<any>") -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    if param != "<any>":
        assert err["param"] == param, err
    if code != "<any>":
        assert err["code"] == code, err
    return err["message"]


@pytest.mark.parametrize("body, param", [
    ({"temperature": -1}, "temperature"),
    ({"temperature": 1000}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"n": 17}, "n"),
    ({"n": 0}, "n"),
    ({"logprobs": 50}, "logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [10 ** 9]}, "prompt"),
    ({"stop": [""]}, "stop"),
    ({"logit_bias": {"1": 500}}, "logit_bias"),   # beyond [-100, 100]
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_bad_completion_params(server, body, param):
    _error(server.http.post("/v1/completions", json={**OK, **body}), 400, param)


@pytest.mark.parametrize("body, param", [
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"prompt": 3}, "prompt"),
    ({"prompt": ["a", 1]}, "prompt"),
    ({"stream": "sometimes"}, "stream"),
    ({"prompt": None}, "prompt"),
])
def test_wrong_types(server, body, param):
    msg = _error(server.http.post("/v1/completions", json={**OK, **body}), 400, param)
    assert param in msg


def test_missing_field(server):
    _error(server.http.post("/v1/completions", json={"max_tokens": 2}), 400, "prompt")
    _error(server.http.post("/v1/chat/completions", json={"max_tokens": 2}), 400, "messages")
    _error(server.http.post("/v1/chat/completions", json={"messages": []}), 400, "messages")


def test_malformed_json(server):
    for raw in (b"{not json", b"", b"[1, 2]", b'"text"'):
        msg = _error(server.http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"}),
                     400, None)
        assert "JSON" in msg or "body" in msg


def test_unknown_model(server):
    msg = _error(server.http.post("/v1/completions", json={**OK, "model": "gpt-9"}), 404, "model", "model_not_found")
    assert "gpt-9" in msg
    _error(server.http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}),
           404, "model", "model_not_found")
    _error(server.http.get("/v1/models/gpt-9"), 404, "model", "model_not_found")


def test_prompt_longer_than_context(server):
    limit = server.engine.max_model_len
    ids = [100] * (limit + 10)
    msg = _error(server.http.post("/v1/completions", json={**OK, "prompt": ids}), 400, "prompt",
                 "context_length_exceeded")
    assert f"{limit + 10} tokens" in msg and "11 more" in msg


def test_prompt_plus_max_tokens_over_context(server):
    limit = server.engine.max_model_len
    msg = _error(server.http.post("/v1/completions", json={**OK, "prompt": [100] * 10, "max_tokens": limit}),
                 400, "max_tokens", "context_length_exceeded")
    assert "10 too many" in msg
    _error(server.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                          "max_completion_tokens": limit}),
           400, "max_completion_tokens", "context_length_exceeded")


def test_chat_specific(server):
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    _error(server.http.post("/v1/chat/completions", json={**chat, "top_logprobs": 2}), 400, "top_logprobs")
    _error(server.http.post("/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 99}), 400,
           "top_logprobs")
    _error(server.http.post("/v1/chat/completions", json={**chat, "max_completion_tokens": 0}), 400,
           "max_completion_tokens")
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    _error(server.http.post("/v1/chat/completions", json={**chat, "messages": [{"role": "user", "content": image}]}),
           400, "messages.0.content")


def test_body_too_large(server):
    big = b'{"prompt": "' + b"a" * (5 << 20) + b'"}'
    msg = _error(server.http.post("/v1/completions", content=big, headers={"Content-Type": "application/json"}),
                 413, None, "request_too_large")
    assert "limit" in msg

    def chunks():   # no Content-Length: the limit applies to the bytes streamed in
        yield b'{"prompt": "'
        for _ in range(5):
            yield b"a" * (1 << 20)
        yield b'"}'
    _error(server.http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}),
           413, None, "request_too_large")


def test_unknown_route_and_method(server):
    _error(server.http.get("/v1/nothing"), 404)
    _error(server.http.get("/v1/completions"), 405)


def test_still_serving_after_errors(server):
    r = server.http.post("/v1/completions", json=OK)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert server.http.get("/health").status_code == 200
