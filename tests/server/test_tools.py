"""Tool calling with the official openai SDK over HTTP: required and named tool_choice give
parseable calls whose arguments match the schemas (streamed too), a two-turn tool conversation,
none/auto, and bad tool definitions as 400s; plus the parser and the prompt rendering."""

from __future__ import annotations

import json

import jsonschema
import pytest

from conveyor.server.tools import parse_tool_calls, plan_tools, render_messages

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 24}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a timezone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_calls(calls) -> list[str]:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [c.function.name for c in calls]


@pytest.mark.slow
def test_required_and_named_tool_choice(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=120, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls"
    assert set(check_calls(r.choices[0].message.tool_calls)) <= set(SCHEMAS)
    r = client.chat.completions.create(model=model_name, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0.7,
                                       seed=3, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert check_calls(r.choices[0].message.tool_calls) == ["get_time"]


@pytest.mark.slow
def test_streamed_tool_calls_accumulate_like_openai(client, model_name):
    stream = client.chat.completions.create(model=model_name, messages=ASK, tools=TOOLS, stream=True, max_tokens=80,
                                            temperature=0, tool_choice={"type": "function",
                                                                        "function": {"name": "get_weather"}})
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in stream:
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                acc = calls.setdefault(d.index, {"name": "", "arguments": ""})
                acc["name"] += d.function.name or ""
                acc["arguments"] += d.function.arguments or ""
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
    assert reasons == ["tool_calls"] and [c["name"] for c in calls.values()] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)


@pytest.mark.slow
def test_two_turn_tool_conversation(client, model_name):
    first = client.chat.completions.create(model=model_name, messages=ASK, tools=TOOLS, max_tokens=80,
                                           temperature=0, tool_choice={"type": "function",
                                                                       "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    second = client.chat.completions.create(model=model_name, messages=history, tools=TOOLS, max_tokens=24,
                                            temperature=0, tool_choice="none")
    assert second.choices[0].message.tool_calls is None and second.choices[0].message.content
    auto = client.chat.completions.create(model=model_name, messages=history, tools=TOOLS, max_tokens=24,
                                          temperature=0)
    msg = auto.choices[0].message
    assert msg.content or msg.tool_calls   # auto: the model decides; either way a well-formed message


@pytest.mark.slow
@pytest.mark.parametrize("extra,param", [
    ({"tool_choice": "required"}, "tool_choice"),                                       # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": TOOLS + TOOLS}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tools_are_400s(server, model_name, extra, param):
    r = server.http.post("/v1/chat/completions", json={"model": model_name, "messages": ASK, "max_tokens": 4,
                                                       **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_hermes_and_json_parsers():
    text = 'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'
    content, calls = parse_tool_calls(text, "hermes")
    assert content == "Let me check." and calls[0]["function"]["name"] == "get_time"
    assert json.loads(calls[0]["function"]["arguments"]) == {"timezone": "UTC"}
    assert parse_tool_calls("<tool_call>not json</tool_call>", "hermes") == ("<tool_call>not json</tool_call>", [])
    content, calls = parse_tool_calls('[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]', "json")
    assert content is None and [c["function"]["name"] for c in calls] == ["a", "b"]
    assert parse_tool_calls("plain text", "json") == ("plain text", [])


def test_tools_reach_a_template_without_tool_support():
    plan = plan_tools(TOOLS, "auto", None)
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    history = [{"role": "system", "content": "Be brief."}, *ASK,
               {"role": "assistant", "content": None,
                "tool_calls": [{"id": "c1", "type": "function",
                                "function": {"name": "get_time", "arguments": '{"timezone": "UTC"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    msgs, tools = render_messages(history, template, plan)
    assert tools is None and msgs[0]["content"].startswith("Be brief.") and "<tools>" in msgs[0]["content"]
    assert '"name": "get_weather"' in msgs[0]["content"]
    assert msgs[2]["content"] == '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'
    assert msgs[3]["content"] == "<tool_response>\n12:00\n</tool_response>"
    msgs, tools = render_messages(history, "{{ tools }} {{ m.tool_calls }}", plan)   # the template's own way
    assert tools == plan.tools and msgs[2]["tool_calls"] and msgs[2]["content"] == ""
    assert render_messages(ASK, template, plan_tools(TOOLS, "none", None)) == (ASK, None)
