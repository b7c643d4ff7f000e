"""Reading chat outputs: reasoning split out (--reasoning-parser), tool calls streamed as their
arguments are generated, tool arguments held to the keys their schema declares, and no tool-call
markup left in the content when max_tokens cuts a call."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from conveyor.server.parsing import (ContentDelta, OutputStream, ReasoningDelta, ToolArgsDelta, ToolCallStart,
                                     parse_output)
from conveyor.server.reasoning import split_reasoning
from conveyor.server.tools import plan_tools, strict_objects

from conftest import start_server

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                                                         "utc": {"type": "boolean"}},
                                                        "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


# ---- the parser, without a model ------------------------------------------------------------

CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os\\"lo", "n": [1, {"a": "}"}]}}\n</tool_call>'
CALL_B = '<tool_call>\n{"arguments": {"city": "Rome"}, "name": "get_time"}\n</tool_call>'   # name last: sent whole
BAD_A = '<tool_call>\n{"name": "get_time", "arguments": {"a": 1}} trailing\n</tool_call>'   # read as a call, invalid
BAD_B = '<tool_call>{"name": "get_time", "arguments": {"a": 1</tool_call>'
STRING_ARGS = '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}\n</tool_call>'
PIECES = ["Sure. ", "\n", CALL_A, CALL_B, "<tool_call>{not json}</tool_call>", " bye", "<think>", "</think>", "hmm ",
          BAD_A, BAD_B, STRING_ARGS]
CUT = '<tool_call>\n{"name": "get_time", "argu'   # max_tokens ended the output inside a call


def _run(text: str, cuts: list[int], tools, parser=None, prompt=None) -> list:
    reader, events, last = OutputStream(tools, parser, prompt), [], 0
    for cut in sorted(set(c % (len(text) + 1) for c in cuts)) + [len(text)]:
        events += reader.feed(text[last:cut])
        last = cut
    return events + reader.feed("", finished=True), reader


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=7), st.booleans(), st.lists(st.integers(0, 10_000), max_size=40),
       st.sampled_from([None, "qwen3", "deepseek_r1"]))
def test_streamed_reading_equals_the_whole_output_read_at_once(pieces, cut, cuts, parser):
    plan = plan_tools([WEATHER, TIME], "auto", None)
    text = "".join(pieces) + (CUT if cut else "")
    events, reader = _run(text, cuts, plan, parser)
    whole = parse_output(text, plan, parser)
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == (whole.content or "")
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == (whole.reasoning or "")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in reader.calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls]
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert len({s.index for s in starts}) == len(starts)   # every announced call has its own index
    for call in reader.calls:   # each finished call: started once, its argument pieces add up to valid JSON
        k = next(s.index for s in starts if s.id == call["id"])
        args = "".join(e.text for e in events if isinstance(e, ToolArgsDelta) and e.index == k)
        assert args == call["function"]["arguments"]
        assert isinstance(json.loads(args), dict)
    expected_calls = sum(text.count(p) for p in (CALL_A, CALL_B, STRING_ARGS)) if parser is None else None
    if expected_calls is not None:
        assert len(whole.tool_calls) == expected_calls - (CUT in text and False)
    if whole.content is not None:   # no markup of a valid call in the content (invalid blocks stay as written)
        rest = whole.content.replace(BAD_A, "").replace(BAD_B, "")
        assert '{"name"' not in rest and '"arguments"' not in rest


def test_a_call_cut_by_max_tokens_is_neither_content_nor_a_call():
    plan = plan_tools([WEATHER], "auto", None)
    out = parse_output('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"ci', plan)
    assert out.content == "I will check." and out.tool_calls == []
    out = parse_output("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"
                       "\n<tool_call>\n{\"na", plan)
    assert out.content is None and [json.loads(c["function"]["arguments"]) for c in out.tool_calls] == \
        [{"city": "Oslo"}]


@pytest.mark.parametrize("text, parser, prompt, expected", [
    ("<think>\nplan</think>\n\nAnswer", "qwen3", None, ("\nplan", "Answer")),
    ("Answer", "qwen3", None, (None, "Answer")),
    ("plan</think>Answer", "qwen3", "<|im_start|>assistant\n<think>\n", ("plan", "Answer")),
    ("Answer", "qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", (None, "Answer")),   # thinking off
    ("plan</think>Answer", "deepseek_r1", None, ("plan", "Answer")),
    ("<think>plan</think>Answer", "deepseek_r1", None, ("plan", "Answer")),
    ("still thinking", "deepseek_r1", None, ("still thinking", "")),            # cut: all reasoning
    ("<think>still thinking", "qwen3", None, ("still thinking", "")),
])
def test_reasoning_parsers(text, parser, prompt, expected):
    assert split_reasoning(text, parser, prompt) == expected


def test_strict_objects_only_closes_objects_that_list_their_keys():
    schema = {"type": "object", "properties": {"opts": {"type": "object", "properties": {"a": {"type": "string"}}},
                                               "free": {"type": "object"},
                                               "properties": {"type": "string"}},   # a key named "properties"
              "$defs": {"x": {"type": "object", "properties": {}, "additionalProperties": True}}}
    out = strict_objects(schema)
    assert out["additionalProperties"] is False and out["properties"]["opts"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["free"]            # a free-form dict stays free
    assert set(out["properties"]) == {"opts", "free", "properties"}
    assert out["$defs"]["x"]["additionalProperties"] is True                   # said explicitly: kept
    assert schema["properties"]["opts"] == {"type": "object", "properties": {"a": {"type": "string"}}}   # not mutated


# ---- over HTTP, with the demo model ---------------------------------------------------------

@pytest.mark.slow
def test_streamed_tool_call_arguments_arrive_as_generated(client, model_name):
    kw = dict(model=model_name, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0,
              max_tokens=60, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    calls = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or [])]
    assert calls[0].id and calls[0].function.name == "get_weather" and calls[0].type == "function"
    pieces = [tc.function.arguments for tc in calls[1:] if tc.function and tc.function.arguments]
    assert len(pieces) >= 3                     # streamed piece by piece, not sent at the end in one go
    finishes = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert finishes == ["tool_calls"] == [whole.choices[0].finish_reason]
    first_args = next(i for i, c in enumerate(chunks) for ch in c.choices
                      if ch.delta.tool_calls and ch.delta.tool_calls[0].function.arguments)
    assert first_args < len(chunks) - 2         # arguments came before the finish chunk
    expected = whole.choices[0].message.tool_calls[0]
    assert json.loads("".join(pieces)) == json.loads(expected.function.arguments)
    assert not any(ch.delta.content for c in chunks for ch in c.choices)


@pytest.mark.slow
def test_tool_arguments_have_only_declared_keys_langchain_any(server, model_name):
    """LangChain's bind_tools(tool_choice="any") with two tools whose schemas do not say
    additionalProperties: every call's arguments are keys the tool declares."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Get the weather in a city."""
        return "sunny"

    @tool
    def get_population(city: str, year: int) -> int:
        """Get the population of a city in a year."""
        return 1

    llm = langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key="none", model=model_name,
                                      max_tokens=120, max_retries=0)
    declared = {"get_weather": {"city"}, "get_population": {"city", "year"}}
    for temperature, seed in ((0, None), (1.0, 1), (1.0, 2)):
        msg = llm.bind_tools([get_weather, get_population], tool_choice="any").invoke(
            "What is the weather in Oslo?", temperature=temperature, seed=seed)
        assert msg.tool_calls, msg
        for call in msg.tool_calls:
            assert set(call["args"]) <= declared[call["name"]], call
        assert "<tool_call>" not in (msg.content or "")


@pytest.mark.slow
def test_max_tokens_cutting_a_call_leaves_no_markup(client, model_name):
    for stream in (False, True):
        kw = dict(model=model_name, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=0,
                  max_tokens=8, stream=stream)
        if stream:
            chunks = list(client.chat.completions.create(**kw))
            content = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
            reason = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
        else:
            r = client.chat.completions.create(**kw)
            content, reason = r.choices[0].message.content or "", [r.choices[0].finish_reason]
            assert not r.choices[0].message.tool_calls
        assert reason == ["length"] and "<tool_call>" not in content and "get_" not in content


# A template that opens a <think> block in the generation prompt unless enable_thinking is false
# (as Qwen3's does the other way round: it closes an empty block when thinking is off).
THINK_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
                  "{% else %}<think>\n{% endif %}{% endif %}")
# The demo model does not think; a grammar makes it write some reasoning, the end tag, an answer.
THINK_THEN_ANSWER = {"regex": "[a-z]{2,8}( [a-z]{2,8}){1,3}</think>[A-Z][a-z]{2,8}( [a-z]{2,8}){1,3}"}


@pytest.fixture(scope="module")
def reasoning_server(demo_model):
    handle = start_server(demo_model, reasoning_parser="qwen3")
    yield handle
    handle.stop()


@pytest.mark.slow
def test_reasoning_content_split_streamed_and_not(reasoning_server):
    client = reasoning_server.openai()
    kw = dict(model=reasoning_server.engine.model_name, messages=ASK, temperature=0, max_tokens=40,
              extra_body={"chat_template": THINK_TEMPLATE, "structured_outputs": THINK_THEN_ANSWER})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message.model_dump()
    assert msg["reasoning_content"] and msg["reasoning"] == msg["reasoning_content"]
    assert "</think>" not in msg["reasoning_content"] and "</think>" not in msg["content"]
    assert msg["content"][0].isupper()
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [ch.delta.model_dump() for c in chunks for ch in c.choices]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all(not d.get("reasoning_content") for d in deltas[first_content:])   # reasoning, then the answer
    # enable_thinking=False: the template closes the block in the prompt, the output is all answer
    off = client.chat.completions.create(model=kw["model"], messages=ASK, temperature=0, max_tokens=12,
                                         extra_body={"chat_template": THINK_TEMPLATE,
                                                     "chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.model_dump().get("reasoning_content") is None
    assert off.choices[0].message.content


@pytest.mark.slow
def test_no_reasoning_parser_leaves_the_text_alone(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=ASK, temperature=0, max_tokens=30,
                                       extra_body={"chat_template": THINK_TEMPLATE,
                                                   "structured_outputs": THINK_THEN_ANSWER})
    msg = r.choices[0].message.model_dump()
    assert "</think>" in msg["content"] and "reasoning_content" not in msg


def test_response_format_strict_true_reads_the_schema_strictly():
    from conveyor.server.inputs import structured_outputs
    from conveyor.server.protocol import ChatCompletionRequest

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    for strict, closed in ((True, True), (False, False), (None, False)):
        spec = {"name": "w", "schema": schema, **({} if strict is None else {"strict": strict})}
        req = ChatCompletionRequest(messages=ASK, response_format={"type": "json_schema", "json_schema": spec})
        assert (structured_outputs(req).json.get("additionalProperties") is False) == closed
    assert "additionalProperties" not in schema


@pytest.mark.slow
def test_strict_response_format_output_has_only_listed_keys(client, model_name):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
    finished = 0
    for seed in range(3):
        r = client.chat.completions.create(
            model=model_name, messages=ASK, temperature=1.0, seed=seed, max_tokens=60,
            response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}})
        if r.choices[0].finish_reason == "stop":
            finished += 1
            assert set(json.loads(r.choices[0].message.content)) == {"city"}
    assert finished   # (a closed object with one short string finishes well within 60 tokens)


def test_a_constrained_output_is_read_without_the_reasoning_parser():
    """A grammar holds from the first token, so the output has no reasoning: with deepseek_r1 (which
    otherwise reads everything before </think> as reasoning) a required call is still a call."""
    from conveyor.sampling.params import SamplingParams
    from conveyor.sampling.structured import StructuredOutputsParams
    from conveyor.server.reasoning import parser_for

    plan = plan_tools([WEATHER], "required", None)
    constrained = SamplingParams(structured_outputs=StructuredOutputsParams(grammar=plan.constraint.grammar))
    assert parser_for("deepseek_r1", constrained) is None and parser_for("deepseek_r1", SamplingParams()) == "deepseek_r1"
    thinks = SamplingParams(structured_outputs=StructuredOutputsParams(**THINK_THEN_ANSWER))
    assert parser_for("qwen3", thinks) == "qwen3"   # the constraint writes the reasoning's end itself
    out = parse_output(CALL_A, plan, parser_for("deepseek_r1", constrained))
    assert out.reasoning is None and len(out.tool_calls) == 1


@pytest.mark.slow
def test_reasoning_server_still_answers_constrained_requests(reasoning_server):
    client = reasoning_server.openai()
    kw = dict(model=reasoning_server.engine.model_name, messages=ASK, temperature=0, max_tokens=60,
              extra_body={"chat_template": THINK_TEMPLATE})
    r = client.chat.completions.create(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, **kw)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls
    assert r.choices[0].message.model_dump().get("reasoning_content") is None
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    r = client.chat.completions.create(response_format={"type": "json_schema", "json_schema": {
        "name": "w", "schema": schema, "strict": True}}, **kw)
    assert "city" in json.loads(r.choices[0].message.content)
