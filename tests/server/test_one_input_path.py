"""Every API route goes through the one input processor (frontend/inputs.py): the same bad input is
refused by each with the same code, under the route's own name for the field; and nothing of a
refused request reaches the engine."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

def _routes(model: str, text: str, max_tokens: int | None) -> dict[str, tuple[str, dict, str, str | None]]:
    """route -> (path, body, the route's name for the prompt, its name for max tokens (None: none refused))."""
    chat = [{"role": "user", "content": text}]
    limit = {} if max_tokens is None else {"max_tokens": max_tokens}
    return {
        "completions": ("/v1/completions", {"prompt": text, "max_tokens": max_tokens or 2}, "prompt", "max_tokens"),
        "chat": ("/v1/chat/completions", {"messages": chat, **limit}, "messages", "max_tokens"),
        "chat (max_completion_tokens)": ("/v1/chat/completions",
                                         {"messages": chat, "max_completion_tokens": max_tokens or 2},
                                         "messages", "max_completion_tokens"),
        "responses": ("/v1/responses", {"model": model, "input": text, "max_output_tokens": max_tokens or 16},
                      "input", "max_output_tokens"),
        "messages": ("/v1/messages", {"model": model, "messages": chat, "max_tokens": max_tokens or 2},
                     "messages", None),   # Anthropic's max_tokens is capped to the room left, not refused
        "embeddings": ("/v1/embeddings", {"input": text}, "input", None),
        "score": ("/v1/score", {"text_1": "query", "text_2": text}, "text_2", None),
    }


def _refusal(server, path: str, body: dict) -> tuple[int, str | None, str | None]:
    """(status, param, code) of an OpenAI-style error. Anthropic's error body has neither param nor code:
    /v1/messages reports the param in its message ("messages: ...") and the code as its error type."""
    r = server.http.post(path, json=body)
    if r.status_code == 200:
        return 200, None, None
    err = r.json()["error"]
    if path == "/v1/messages":
        assert err["type"] == "invalid_request_error", err
        param = "messages" if "context" in err["message"] else None
        return r.status_code, param, "context_length_exceeded" if "context" in err["message"] else None
    return r.status_code, err.get("param"), err.get("code")


def test_every_route_refuses_the_same_inputs_under_its_own_names(server):
    model, limit = server.engine.model_name, server.engine.max_model_len
    before = server.engine.stats()
    # 1. longer than the context by its characters alone (refused before tokenizing)
    huge = "a" * (limit * server.engine.tokenizer.max_token_chars + 1)
    # 2. longer than the context in tokens (few characters per token)
    long = " x" * (limit + 8)
    # 3. fits, but the prompt plus max tokens does not
    short = "Say hello."
    for name, (path, body, prompt_param, _) in _routes(model, huge, None).items():
        assert _refusal(server, path, body) == (400, prompt_param, "context_length_exceeded"), (name, "chars")
    for name, (path, body, prompt_param, _) in _routes(model, long, None).items():
        assert _refusal(server, path, body) == (400, prompt_param, "context_length_exceeded"), (name, "tokens")
    for name, (path, body, _, max_param) in _routes(model, short, limit).items():
        if max_param is not None:   # (the others have no such rule: Anthropic's is capped to the room left)
            assert _refusal(server, path, body) == (400, max_param, "context_length_exceeded"), name
    after = server.engine.stats()
    # nothing of a refused request reached the engine
    assert (after.num_finished, after.num_aborted, after.num_errors, after.prompt_tokens_total) == \
        (before.num_finished, before.num_aborted, before.num_errors, before.prompt_tokens_total)
    assert after.num_running == 0 and after.num_waiting == 0


@pytest.mark.parametrize("bad, param", [
    ({"logit_bias": {"999999999": 1}}, "logit_bias"),
    ({"stop": [""]}, "stop"),
    ({"temperature": -1}, "temperature"),
])
def test_sampling_refusals_name_the_same_field_on_completions_and_chat(server, bad, param):
    for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})):
        status, got, _ = _refusal(server, path, {**body, **bad})
        assert (status, got) == (400, param), path
