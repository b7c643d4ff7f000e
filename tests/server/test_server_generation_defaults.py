"""Default sampling parameters over HTTP: a field a request omits takes the model's default
(--generation-config / --override-generation-config), a field it gives wins; the README's first example
answers sensibly on the demo model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from conftest import start_server
from conveyor.sampling.params import SamplingParams
from conveyor.frontend.inputs import ApiNames, InputProcessor, Prompt

pytestmark = pytest.mark.slow   # real demo model behind a real HTTP server

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture(scope="module")
def defaults_server(demo_model):
    handle = start_server(demo_model, engine_options={"override_generation_config": '{"max_tokens": 5}'})
    yield handle
    handle.stop()


def test_omitted_fields_take_the_models_defaults_and_given_ones_win(defaults_server):
    client = defaults_server.openai()
    model = defaults_server.engine.model_name
    # the demo model's own default (greedy) merged with the override's max_tokens
    assert defaults_server.engine.generation_defaults == {"temperature": 0.0, "max_tokens": 5}
    messages = [{"role": "user", "content": "Tell me a long story about a dragon."}]
    chat = client.chat.completions.create(model=model, messages=messages, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"
    greedy = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=5,
                                            extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == greedy.choices[0].message.content   # temperature omitted: 0
    # completions: the default replaces the API's 16 only when max_tokens is left out
    text = client.completions.create(model=model, prompt="Once upon a time", extra_body={"ignore_eos": True})
    assert text.usage.completion_tokens == 5
    given = client.completions.create(model=model, prompt="Once upon a time", max_tokens=3,
                                      extra_body={"ignore_eos": True})
    assert given.usage.completion_tokens == 3
    hot = [client.completions.create(model=model, prompt="Once upon a time", temperature=1.5, seed=seed,
                                     max_tokens=16, extra_body={"ignore_eos": True}).choices[0].text
           for seed in (1, 2)]
    assert hot[0] != hot[1]   # a given temperature wins over the greedy default


def test_a_default_max_tokens_is_capped_by_the_context_left():
    params, prompt = SamplingParams(max_tokens=None), Prompt(None, list(range(20)))
    for defaults, want in (({"max_tokens": 100}, 30), ({"max_tokens": 10}, 10), ({}, 30)):
        inputs = InputProcessor(None, 1000, 50, [0], generation_defaults=defaults)
        assert inputs.process(prompt, params, api=ApiNames()).params.max_tokens == want
    assert params.max_tokens is None   # the caller's params are not changed
    assert inputs.process(prompt, params).params.max_tokens is None   # offline: up to the context, as given


def readme_first_request() -> tuple[str, dict]:
    """The path and JSON body of the README's first curl command."""
    match = re.search(r"curl -s http://127\.0\.0\.1:8000(\S+) .*?-d '(\{.*?\})'", README.read_text(), re.S)
    assert match, "the README's first example is a curl command with a -d JSON body"
    return match.group(1), json.loads(match.group(2))


def test_the_readmes_first_example_names_paris(server):
    """As a newcomer meets it: the demo model at its defaults, the example's exact parameters."""
    path, body = readme_first_request()
    assert "What is the capital of France?" in json.dumps(body) and "temperature" not in body
    r = httpx.post(f"{server.url}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
