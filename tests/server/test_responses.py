"""/v1/responses with the openai SDK and the OpenAI Agents SDK: text in/out (same text as chat),
items, streaming events, json_schema, function tools, stored responses and previous_response_id,
background mode and cancel, the incomplete terminal event, reasoning items, and 400s."""

from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest

from conveyor.server.response_store import ResponseStore, StoredResponse
from conftest import start_server

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}, "strict": True}


def _read_stream(stream, delta_type: str) -> tuple[list[str], str, object]:
    """(event types, the text of the `delta_type` events, the last event) of a Responses stream."""
    kinds, text, last = [], "", None
    for ev in stream:
        kinds.append(ev.type)
        if ev.type == delta_type:
            text += ev.delta
        last = ev
    return kinds, text, last

def _user(text: str) -> dict:
    return {"role": "user", "content": [{"type": "input_text", "text": text}]}


# ---- the store, without a model --------------------------------------------------------------

def _entry(text: str) -> StoredResponse:
    return StoredResponse({"status": "completed", "output": [{"type": "message", "text": text}]}, [], 0)


def test_store_evicts_least_recently_used_by_count_and_bytes():
    store = ResponseStore(max_entries=2, max_bytes=10_000)
    store.put("a", _entry("x"))
    store.put("b", _entry("y"))
    assert store.get("a") is not None          # a is now the most recently used
    store.put("c", _entry("z"))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    small = ResponseStore(max_entries=100, max_bytes=300)
    for k in range(5):
        small.put(str(k), _entry("w" * 60))
    assert small.bytes <= 300 and small.get("4") is not None and small.get("0") is None
    assert small.bytes == sum(small.get(k).size for k in ("2", "3", "4") if small.get(k) is not None)


def test_store_never_evicts_a_running_response():
    store = ResponseStore(max_entries=1)
    running = StoredResponse({"status": "in_progress", "output": []}, [], 0, background=True)
    store.put("run", running)
    store.put("done", _entry("x"))
    assert store.get("run") is running and store.get("done") is None


# ---- text in, text out -----------------------------------------------------------------------

@pytest.mark.slow
def test_text_in_text_out_equals_chat(client, model_name):
    r = client.responses.create(model=model_name, input="What is the capital of France?", max_output_tokens=12,
                                temperature=0)
    chat = client.chat.completions.create(model=model_name, max_tokens=12, temperature=0,
                                          messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.status in ("completed", "incomplete")
    assert (r.status == "incomplete") == (chat.choices[0].finish_reason == "length")


@pytest.mark.slow
def test_items_instructions_and_stream(client, model_name):
    items = [_user("Count to three.")]
    whole = client.responses.create(model=model_name, input=items, instructions="Be brief.", max_output_tokens=10,
                                    temperature=0)
    with client.responses.stream(model=model_name, input=items, instructions="Be brief.", max_output_tokens=10,
                                 temperature=0) as stream:
        kinds, text, last = _read_stream(stream, "response.output_text.delta")
    assert text == whole.output_text == last.response.output_text
    # Changed: a cut response now ends with response.incomplete (it ended with response.completed).
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == ("response.incomplete" if whole.status == "incomplete" else "response.completed")


@pytest.mark.slow
def test_stream_cut_by_max_output_tokens_ends_incomplete(client, model_name):
    kw = dict(model=model_name, input="Tell me a long story about a dragon.", max_output_tokens=5, temperature=0)
    whole = client.responses.create(**kw)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        try:
            final = stream.get_final_response()
        except RuntimeError:   # openai-python records a final response only on response.completed
            final = None
    last = events[-1]
    assert last.type == "response.incomplete" and "response.completed" not in [e.type for e in events]
    assert last.response.status == "incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output_text == whole.output_text and last.response.usage.output_tokens == 5
    assert last.response.output[0].status == "incomplete"
    if final is not None:
        assert final.status == "incomplete"


@pytest.mark.slow
def test_json_schema_format(client, model_name):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    r = client.responses.create(model=model_name, input="Name a city.", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "c", "schema": schema}})
    assert set(json.loads(r.output_text)) == {"city"}


@pytest.mark.slow
def test_empty_tools_and_include_change_nothing(client, model_name):
    kw = dict(model=model_name, input="Say hello.", max_output_tokens=8, temperature=0)
    plain = client.responses.create(**kw)
    agentsy = client.responses.create(**kw, tools=[], include=[])
    assert agentsy.output_text == plain.output_text and agentsy.tools == []


@pytest.mark.slow
@pytest.mark.parametrize("body,param,status", [
    ({"tools": [{"type": "web_search"}]}, "tools", 400),
    ({"tools": [WEATHER, {"type": "file_search", "vector_store_ids": ["v"]}]}, "tools", 400),
    ({"include": ["reasoning.encrypted_content"]}, "include", 400),
    ({"tool_choice": {"type": "web_search"}, "tools": [WEATHER]}, "tool_choice", 400),
    ({"tool_choice": "required"}, "tool_choice", 400),
    ({"background": True, "store": False}, "background", 400),
    ({"max_output_tokens": 0}, "max_output_tokens", 400),
    ({"truncation": "auto"}, "truncation", 400),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id", 404),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input", 400),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", 400),
])
def test_bad_fields_are_openai_errors(server, model_name, body, param, status):
    r = server.http.post("/v1/responses", json={"model": model_name, "input": "hi", **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param
    if status == 404:
        assert err["code"] == "previous_response_not_found"


# ---- function tools ----------------------------------------------------------------------------

@pytest.mark.slow
def test_required_tool_call_and_round_trip(client, model_name):
    r = client.responses.create(model=model_name, input="What is the weather in Paris?", tools=[WEATHER],
                                tool_choice="required", parallel_tool_calls=False, temperature=0,
                                max_output_tokens=60)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather" and call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.status == "completed" and set(json.loads(call.arguments)) == {"city"}
    assert r.tool_choice == "required" and r.tools[0].name == "get_weather"
    # The tool's answer goes back on top of the stored conversation.
    follow = client.responses.create(model=model_name, previous_response_id=r.id, tools=[WEATHER],
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "Sunny, 24 C"}], max_output_tokens=20, temperature=0)
    assert follow.previous_response_id == r.id and follow.output_text
    # ... the same as sending the whole conversation, function_call item included.
    whole = client.responses.create(model=model_name, tools=[WEATHER], max_output_tokens=20, temperature=0,
                                    input=[_user("What is the weather in Paris?"), call.model_dump(exclude_none=True),
                                           {"type": "function_call_output", "call_id": call.call_id,
                                            "output": "Sunny, 24 C"}])
    assert whole.output_text == follow.output_text


@pytest.mark.slow
def test_named_tool_choice_streams_the_arguments(client, model_name):
    other = {**WEATHER, "name": "get_time", "parameters": {"type": "object", "properties": {}}}
    kinds, deltas = [], ""
    with client.responses.stream(model=model_name, input="Weather in Rome?", tools=[other, WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                 max_output_tokens=60) as stream:
        for ev in stream:
            kinds.append(ev.type)
            if ev.type == "response.output_item.added":
                assert ev.item.type == "function_call" and ev.item.name == "get_weather"
            elif ev.type == "response.function_call_arguments.delta":
                deltas += ev.delta
            elif ev.type == "response.function_call_arguments.done":
                done = ev.arguments
            last = ev
    assert last.type == "response.completed"
    item = [o for o in last.response.output if o.type == "function_call"][0]
    assert deltas == done == item.arguments and set(json.loads(done)) == {"city"}
    assert kinds.index("response.output_item.added") < kinds.index("response.function_call_arguments.delta") \
        < kinds.index("response.function_call_arguments.done") < kinds.index("response.output_item.done")


# ---- stored responses ------------------------------------------------------------------------

@pytest.mark.slow
def test_chain_of_previous_responses_equals_whole_conversation(client, model_name):
    kw = dict(model=model_name, max_output_tokens=8, temperature=0)
    turns = ["My name is Ada.", "What is two plus two?", "What is my name?"]
    r1 = client.responses.create(input=turns[0], **kw)
    r2 = client.responses.create(input=turns[1], previous_response_id=r1.id, **kw)
    r3 = client.responses.create(input=[_user(turns[2])], previous_response_id=r2.id, **kw)
    whole = client.responses.create(input=[_user(turns[0]), *[o.model_dump() for o in r1.output], _user(turns[1]),
                                           *[o.model_dump() for o in r2.output], _user(turns[2])], **kw)
    assert r3.output_text == whole.output_text
    assert r3.usage.input_tokens == whole.usage.input_tokens > r2.usage.input_tokens > r1.usage.input_tokens
    page = client.responses.input_items.list(r3.id, order="asc")
    assert [i.type for i in page.data] == ["message"] and page.data[0].content[0].text == turns[2]


@pytest.mark.slow
def test_get_and_delete(client, model_name, server):
    r = client.responses.create(model=model_name, input="Hi!", max_output_tokens=4, temperature=0,
                                metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.store is True and got.metadata == {"k": "v"}
    deleted = server.http.delete(f"/v1/responses/{r.id}")
    assert deleted.json() == {"id": r.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    assert server.http.delete(f"/v1/responses/{r.id}").status_code == 404
    unstored = client.responses.create(model=model_name, input="Hi!", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.slow
def test_store_bound_evicts_over_http(demo_model):
    handle = start_server(demo_model, num_kv_blocks=64, responses_max_stored=2)
    try:
        c = handle.openai()
        ids = [c.responses.create(input=f"Say {w}.", max_output_tokens=2).id for w in ("a", "b")]
        c.responses.retrieve(ids[0])   # now the most recently used
        ids.append(c.responses.create(input="Say c.", max_output_tokens=2).id)
        c.responses.retrieve(ids[0]), c.responses.retrieve(ids[2])
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(ids[1])
        with pytest.raises(openai.NotFoundError) as e:
            c.responses.create(input="Go on.", previous_response_id=ids[1], max_output_tokens=2)
        assert e.value.body["code"] == "previous_response_not_found"
    finally:
        handle.stop()


# ---- background mode -------------------------------------------------------------------------

def _poll(client, rid: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        r = client.responses.retrieve(rid)
        if r.status not in ("queued", "in_progress"):
            return r
        assert time.monotonic() < deadline, f"still {r.status}"
        time.sleep(0.05)


@pytest.mark.slow
def test_background_poll_equals_foreground(client, model_name):
    kw = dict(model=model_name, input="Name a colour.", max_output_tokens=6, temperature=0)
    fg = client.responses.create(**kw)
    bg = client.responses.create(background=True, **kw)
    assert bg.status in ("queued", "in_progress") and bg.background is True and bg.output == []
    done = _poll(client, bg.id)
    assert done.output_text == fg.output_text and done.status == fg.status
    with pytest.raises(openai.BadRequestError):   # finished: nothing to cancel
        client.responses.cancel(bg.id)
    with pytest.raises(openai.BadRequestError):   # not a background response
        client.responses.cancel(fg.id)


@pytest.mark.slow
def test_background_cancel_aborts_and_frees_kv(client, model_name, server):
    server.wait_idle()
    bg = client.responses.create(model=model_name, input="Tell me a very long story.", background=True,
                                 max_output_tokens=1500, extra_body={"ignore_eos": True})
    try:
        cancelled = client.responses.cancel(bg.id)
    except openai.BadRequestError:   # it finished first (not in practice: 1500 tokens outlast a round trip)
        assert client.responses.retrieve(bg.id).status in ("completed", "incomplete")
    else:
        assert cancelled.status == "cancelled" and cancelled.output == []
        assert client.responses.cancel(bg.id).status == "cancelled"   # idempotent
        assert client.responses.retrieve(bg.id).status == "cancelled"
    stats = server.wait_idle()   # either way the engine request is gone and every KV block is free
    assert stats.kv_usage == 0.0 and stats.num_free_kv_blocks == stats.num_kv_blocks


# ---- reasoning -------------------------------------------------------------------------------

@pytest.mark.slow
def test_reasoning_item(demo_model):
    # deepseek_r1 reads the output as reasoning up to </think>: a model that never closes it (this
    # one) answers with reasoning only.
    handle = start_server(demo_model, num_kv_blocks=64, reasoning_parser="deepseek_r1")
    try:
        c = handle.openai()
        r = c.responses.create(input="Why is the sky blue?", max_output_tokens=6, temperature=0)
        item = r.output[0]
        assert item.type == "reasoning" and item.id.startswith("rs_") and item.summary == []
        assert item.content[0].type == "reasoning_text" and item.content[0].text
        assert r.usage.output_tokens_details.reasoning_tokens > 0
        with c.responses.stream(model=handle.engine.model_name, input="Why is the sky blue?", max_output_tokens=6,
                                temperature=0) as stream:
            kinds, text, last = _read_stream(stream, "response.reasoning_text.delta")
        assert text == item.content[0].text == last.response.output[0].content[0].text
        assert "response.reasoning_text.done" in kinds and "response.output_text.delta" not in kinds
    finally:
        handle.stop()


# ---- the OpenAI Agents SDK -------------------------------------------------------------------

def _agent(server, model_name, **kw):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, set_tracing_disabled

    set_tracing_disabled(True)
    model = OpenAIResponsesModel(model=model_name, openai_client=server.async_openai())
    settings = kw.pop("settings", {})
    return Agent(name="helper", instructions="You are a helpful assistant.", model=model,
                 model_settings=ModelSettings(**{"temperature": 0, "max_tokens": 24, **settings}), **kw)


@pytest.mark.slow
def test_agents_sdk_agent_without_tools(server, model_name):
    from agents import Runner

    result = asyncio.run(Runner.run(_agent(server, model_name), "Say hello."))
    assert isinstance(result.final_output, str) and result.final_output

    async def streamed() -> str:
        run = Runner.run_streamed(_agent(server, model_name), "Say hello.")
        async for _ in run.stream_events():
            pass
        return run.final_output

    assert asyncio.run(streamed()) == result.final_output


@pytest.mark.slow
def test_agents_sdk_function_tool(server, model_name):
    from agents import Runner, function_tool

    seen: list[dict] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the weather in a city."""
        seen.append({"city": city})
        return f"Sunny in {city}."

    agent = _agent(server, model_name, tools=[get_weather], settings={"tool_choice": "required", "max_tokens": 64})
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert seen and all(isinstance(a["city"], str) and a["city"] for a in seen)
    assert isinstance(result.final_output, str) and result.final_output   # tool_choice reset to auto: it answered
