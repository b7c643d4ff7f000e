"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) with the official anthropic SDK
over HTTP: the same greedy answers and token counts as /v1/chat/completions, stop reasons, streams
that the SDK accumulates into the non-streamed message, a tool-use round trip (streamed too),
thinking blocks from a reasoning parser, x-api-key, and errors in Anthropic's shape; plus the
translation of an Anthropic conversation into chat messages."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from conveyor.server.anthropic import CountTokensRequest, chat_messages
from conftest import start_server

SYSTEM = "Be brief."
ASK = [{"role": "user", "content": "What is 2+2?"}]
GREEDY = {"temperature": 0}   # this SDK has no temperature argument: it goes in the body as is
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)


def _create(claude, model_name, **kw):
    kw.setdefault("max_tokens", 40)
    kw.setdefault("messages", ASK)
    return claude.messages.create(model=model_name, extra_body=GREEDY, **kw)


@pytest.mark.slow
def test_message_matches_chat_completions(claude, client, server, model_name):
    msg = _create(claude, model_name, system=SYSTEM)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.model == model_name and msg.stop_reason == "end_turn" and msg.stop_sequence is None
    chat_messages_ = [{"role": "system", "content": SYSTEM}] + ASK
    chat = client.chat.completions.create(model=model_name, messages=chat_messages_, max_tokens=40, temperature=0)
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop"
    assert msg.usage.output_tokens == chat.usage.completion_tokens
    count = server.http.post("/tokenize", json={"model": model_name, "messages": chat_messages_}).json()["count"]
    assert msg.usage.input_tokens == count == chat.usage.prompt_tokens
    # text blocks are the same text as a string
    blocks = _create(claude, model_name, system=[{"type": "text", "text": SYSTEM}],
                     messages=[{"role": "user", "content": [{"type": "text", "text": ASK[0]["content"]}]}])
    assert blocks.content == msg.content and blocks.usage == msg.usage


@pytest.mark.slow
def test_stop_sequence_and_max_tokens(claude, model_name):
    text = _create(claude, model_name, system=SYSTEM).content[0].text
    word = text.split()[2]
    stopped = _create(claude, model_name, system=SYSTEM, stop_sequences=["zzzz", word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == text[:text.index(word)]
    cut = _create(claude, model_name, system=SYSTEM, max_tokens=3)
    assert cut.stop_reason == "max_tokens" and cut.stop_sequence is None and cut.usage.output_tokens == 3
    assert text.startswith(cut.content[0].text)


@pytest.mark.slow
def test_last_assistant_message_is_continued(claude, client, model_name):
    prefill = ASK + [{"role": "assistant", "content": "The answer is"}]
    msg = _create(claude, model_name, messages=prefill, max_tokens=8)
    chat = client.chat.completions.create(model=model_name, messages=prefill, max_tokens=8, temperature=0,
                                          extra_body={"continue_final_message": True,
                                                      "add_generation_prompt": False})
    assert msg.content[0].text == chat.choices[0].message.content
    assert msg.usage.input_tokens == chat.usage.prompt_tokens


@pytest.mark.slow
def test_stream_accumulates_to_the_message(claude, model_name):
    msg = _create(claude, model_name, system=SYSTEM)
    with claude.messages.stream(model=model_name, max_tokens=40, system=SYSTEM, messages=ASK,
                                extra_body=GREEDY) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert final.id.startswith("msg_") and final.id != msg.id
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in msg.content]
    assert (final.stop_reason, final.stop_sequence, final.usage) == (msg.stop_reason, msg.stop_sequence, msg.usage)


@pytest.mark.slow
def test_tool_use_round_trip(claude, model_name):
    first = _create(claude, model_name, messages=WEATHER_ASK, tools=TOOLS, max_tokens=60,
                    tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["tool_use"]
    use = first.content[0]
    assert use.id.startswith("toolu_") and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER)
    assert set(use.input) <= set(WEATHER["properties"])
    history = WEATHER_ASK + [{"role": "assistant", "content": first.content},
                             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                           "content": [{"type": "text", "text": "21 C, sunny"}]}]}]
    second = _create(claude, model_name, messages=history, tools=TOOLS, max_tokens=24)
    assert second.content and second.content[0].type == "text" and second.content[0].text
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert second.usage.input_tokens > first.usage.input_tokens   # the call and its result are in the prompt


@pytest.mark.slow
def test_streamed_tool_use(claude, model_name):
    choice = {"type": "tool", "name": "get_weather"}
    msg = _create(claude, model_name, messages=WEATHER_ASK, tools=TOOLS, max_tokens=60, tool_choice=choice)
    with claude.messages.stream(model=model_name, max_tokens=60, messages=WEATHER_ASK, tools=TOOLS,
                                tool_choice=choice, extra_body=GREEDY) as stream:
        partial = [e.delta.partial_json for e in stream
                   if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
        final = stream.get_final_message()
    assert len(partial) > 1   # the arguments arrive as they are generated
    assert [b.type for b in final.content] == ["tool_use"] and final.stop_reason == "tool_use"
    assert json.loads("".join(partial)) == final.content[0].input == msg.content[0].input
    assert final.content[0].id.startswith("toolu_") and final.usage == msg.usage


@pytest.mark.slow
def test_count_tokens_is_the_prompt(claude, model_name):
    for kw in ({"system": SYSTEM, "messages": ASK}, {"messages": WEATHER_ASK, "tools": TOOLS}):
        count = claude.messages.count_tokens(model=model_name, **kw)
        msg = _create(claude, model_name, max_tokens=1, **kw)
        assert count.input_tokens == msg.usage.input_tokens


@pytest.mark.slow
def test_output_config_format_constrains_the_text(claude, model_name):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    msg = _create(claude, model_name, messages=[{"role": "user", "content": "Is Paris in France?"}],
                  output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(msg.content[0].text), schema)


@pytest.mark.slow
def test_errors_have_anthropic_shape(claude, model_name, server):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=model_name, max_tokens=8, messages=ASK, extra_body={"frequency_penalty": 1})
    assert e.value.status_code == 400 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "frequency_penalty" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="image"):   # a block type not implemented
        claude.messages.create(model=model_name, max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-nonexistent", max_tokens=8, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=model_name, max_tokens=8,
                               messages=[{"role": "user", "content": "hello " * 20_000}])
    assert "context" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.count_tokens(model=model_name, messages=ASK, extra_body={"max_tokens": 8})
    with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
        claude.messages.create(model=model_name, max_tokens=8, messages=ASK, tool_choice={"type": "any"})
    r = server.http.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # other routes keep the OpenAI shape
    assert "param" in server.http.post("/v1/chat/completions", json={"messages": ASK, "foo": 1}).json()["error"]


@pytest.mark.slow
def test_max_tokens_is_capped_at_the_context(claude, model_name, server):
    msg = _create(claude, model_name, system=SYSTEM, max_tokens=10 ** 6)
    assert msg.stop_reason == "end_turn" and msg.usage.output_tokens < server.engine.max_model_len


@pytest.mark.slow
def test_x_api_key(limited_server, model_name):
    good = anthropic.Anthropic(base_url=limited_server.url, api_key="secret", max_retries=0, timeout=120)
    assert good.messages.count_tokens(model=model_name, messages=ASK).input_tokens > 0
    bad = anthropic.Anthropic(base_url=limited_server.url, api_key="wrong", max_retries=0, timeout=120)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.count_tokens(model=model_name, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(f"{limited_server.url}/v1/messages/count_tokens", json={"model": model_name, "messages": ASK},
                   headers={"Authorization": "Bearer secret"})
    assert r.status_code == 200


class _FailingExecutor:
    """The engine's executor, raising in execute() once `fail_in` more calls have passed (None: never)."""

    def __init__(self, runner):
        self.runner, self.fail_in = runner, None

    def swap(self, swap_out, swap_in) -> None:
        self.runner.swap(swap_out, swap_in)

    def execute(self, plan):
        if self.fail_in is not None:
            self.fail_in -= 1
            if self.fail_in < 0:
                self.fail_in = None
                raise RuntimeError("injected forward failure")
        return self.runner.execute(plan)


@pytest.fixture(scope="module")
def reasoning_server(demo_model):
    """A server with --reasoning-parser deepseek_r1 and an executor that can be made to fail."""
    handle = start_server(demo_model, num_kv_blocks=64, reasoning_parser="deepseek_r1")
    engine = handle.engine.engine
    engine.core.executor = _FailingExecutor(engine.runner)
    yield handle, engine.core.executor
    handle.stop()


@pytest.mark.slow
def test_thinking_blocks_from_the_reasoning_parser(reasoning_server):
    """deepseek_r1 reads an output without </think> as all reasoning: a thinking block, streamed too."""
    handle, _ = reasoning_server
    claude = anthropic.Anthropic(base_url=handle.url, api_key="none", max_retries=0, timeout=120)
    kw = {"model": handle.engine.model_name, "max_tokens": 12, "messages": ASK,
          "thinking": {"type": "enabled", "budget_tokens": 1024}, "extra_body": GREEDY}
    msg = claude.messages.create(**kw)
    assert [b.type for b in msg.content] == ["thinking"] and msg.content[0].thinking
    assert msg.content[0].signature == ""
    with claude.messages.stream(**kw) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert set(deltas) == {"thinking_delta"}
    assert final.content[0].thinking == msg.content[0].thinking and final.stop_reason == msg.stop_reason
    # thinking not enabled: no thinking blocks (as Anthropic's API), and the reasoning is not text either
    plain = claude.messages.create(**{k: v for k, v in kw.items() if k != "thinking"})
    assert all(b.type != "thinking" for b in plain.content)
    assert msg.content[0].thinking not in "".join(b.text for b in plain.content if b.type == "text")


@pytest.mark.slow
def test_engine_failure_mid_stream_is_an_error_event(reasoning_server):
    handle, executor = reasoning_server
    claude = anthropic.Anthropic(base_url=handle.url, api_key="none", max_retries=0, timeout=120)
    executor.fail_in = 3   # the prompt's step and two decode steps run, then the engine fails
    events = []
    with pytest.raises(anthropic.APIStatusError, match="injected forward failure") as e:
        with claude.messages.stream(model=handle.engine.model_name, max_tokens=30, messages=ASK,
                                    extra_body=GREEDY) as stream:
            for ev in stream:
                events.append(ev.type)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "api_error"
    assert events[0] == "message_start" and "message_stop" not in events
    # the engine still serves
    assert claude.messages.create(model=handle.engine.model_name, max_tokens=4, messages=ASK).usage.output_tokens


def test_conversation_translates_to_chat_messages():
    req = CountTokensRequest.model_validate({
        "model": "m", "system": [{"type": "text", "text": "sys"}],
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                              {"type": "text", "text": "Let me look."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"},
                                         {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                                          "content": [{"type": "text", "text": "boom"}]},
                                         {"type": "text", "text": "thanks"}]}]})
    got = [m.model_dump(exclude_none=True) for m in chat_messages(req)]
    assert got == [
        {"role": "system", "content": [{"type": "text", "text": "sys"}]},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}],
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "content": "42", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "Error: boom", "tool_call_id": "toolu_2"},
        {"role": "user", "content": [{"type": "text", "text": "thanks"}]}]
