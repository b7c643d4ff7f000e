"""Structured outputs over real HTTP with the official openai SDK: pydantic parse(), strict
json_schema validated by jsonschema, choice and regex (vLLM's structured_outputs and guided_*),
streaming, bad constraints and unknown fields as 400s naming the field, and a constrained
request that leaves its unconstrained batch-mates untouched."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population: int = Field(ge=0, le=100_000_000)   # a 135M model left unbounded repeats digits


def test_sdk_parse_returns_a_valid_pydantic_object(client, model_name):
    r = client.chat.completions.parse(model=model_name, response_format=City, max_tokens=80, temperature=0,
                                      messages=[{"role": "user", "content": "Describe Paris as JSON."}])
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and city.name and isinstance(city.population, int)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_strict_json_schema_output_validates(client, model_name, seed):
    r = client.chat.completions.create(
        model=model_name, max_tokens=120, temperature=1.0, seed=seed, n=2,
        messages=[{"role": "user", "content": "Invent a person."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_choice_and_regex_constrain(client, model_name):
    choices = ["positive", "negative", "neutral"]
    for body in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        r = client.completions.create(model=model_name, prompt="Sentiment of 'I love it':", max_tokens=10,
                                      temperature=1.0, seed=4, extra_body=body)
        assert r.choices[0].text in choices
    for body in ({"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}}, {"guided_regex": r"[0-9]{3}-[0-9]{4}"}):
        r = client.completions.create(model=model_name, prompt="Call me at", max_tokens=20, temperature=0.8,
                                      seed=5, extra_body=body)
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].text), r.choices[0].text
    r = client.completions.create(model=model_name, prompt="Pick:", max_tokens=10, temperature=1.0,
                                  extra_body={"structured_outputs": {"grammar": 'start: "x" ("y" | "z")'}})
    assert r.choices[0].text in ("xy", "xz")


def test_streamed_constrained_output_parses(client, model_name):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    stream = client.chat.completions.create(model=model_name, max_tokens=120, temperature=0, stream=True,
                                            messages=[{"role": "user", "content": "A person, as JSON."}],
                                            response_format=fmt)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    r = client.chat.completions.create(model=model_name, max_tokens=200, temperature=0,
                                       messages=[{"role": "user", "content": "Say hi as JSON."}],
                                       response_format={"type": "json_object"})
    # Greedy, the demo model closes its object in 44 tokens (unconstrained, it answers in prose).
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_a_constrained_request_does_not_change_its_batch_mates(client, model_name):
    plain = dict(model=model_name, prompt="The history of the printing press", max_tokens=24, temperature=0)
    alone = client.completions.create(**plain).choices[0].text

    def constrained(i):
        return client.completions.create(model=model_name, prompt=f"Person {i}:", max_tokens=60, temperature=0,
                                         extra_body={"structured_outputs": {"json": PERSON}})

    with ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(constrained, i) for i in range(4)]
        mixed = pool.submit(client.completions.create, **plain)
        assert mixed.result().choices[0].text == alone
        for f in futures:
            jsonschema.validate(json.loads(f.result().choices[0].text), PERSON)


@pytest.mark.parametrize("body,param,needle", [
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex", "one output constraint"),
    ({"structured_outputs": {"regex": "(unclosed"}}, None, "regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs", "xml"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "unsupported field"),
    ({"use_beam_search": True}, "use_beam_search", "unsupported field"),
    ({"mm_processor_kwargs": {}}, "mm_processor_kwargs", "unsupported field"),
])
def test_bad_constraints_and_unknown_fields_are_400s(server, model_name, body, param, needle):
    r = server.http.post("/v1/completions", json={"model": model_name, "prompt": "hi", "max_tokens": 3, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["param"] == param
    assert server.http.get("/health").status_code == 200


def test_harmless_openai_fields_are_accepted(server, model_name):
    r = server.http.post("/v1/chat/completions", json={
        "model": model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"})
    assert r.status_code == 200, r.text
