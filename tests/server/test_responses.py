"""The minimal /v1/responses with the openai SDK: text in/out (same text as chat), instructions,
message items, streaming events, json_schema text format, and unsupported fields as 400s."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_text_in_text_out_equals_chat(client, model_name):
    r = client.responses.create(model=model_name, input="What is the capital of France?", max_output_tokens=12,
                                temperature=0)
    chat = client.chat.completions.create(model=model_name, max_tokens=12, temperature=0,
                                          messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.status in ("completed", "incomplete")


def test_items_instructions_and_stream(client, model_name):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Count to three."}]}]
    whole = client.responses.create(model=model_name, input=items, instructions="Be brief.", max_output_tokens=10,
                                    temperature=0)
    kinds, text = [], ""
    with client.responses.stream(model=model_name, input=items, instructions="Be brief.", max_output_tokens=10,
                                 temperature=0) as stream:
        for ev in stream:
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                text += ev.delta
        final = stream.get_final_response()
    assert text == whole.output_text == final.output_text
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"


def test_json_schema_format(client, model_name):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    r = client.responses.create(model=model_name, input="Name a city.", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "c", "schema": schema}})
    assert set(json.loads(r.output_text)) == {"city"}


@pytest.mark.parametrize("body,param", [({"tools": []}, "tools"), ({"previous_response_id": "resp_1"},
                                                                   "previous_response_id"),
                                        ({"store": True}, "store")])
def test_unsupported_response_fields(server, model_name, body, param):
    r = server.http.post("/v1/responses", json={"model": model_name, "input": "hi", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
