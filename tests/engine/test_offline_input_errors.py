"""Every malformed offline input (``LLM.generate`` / ``chat`` / ``embed``) gets an InvalidRequestError
naming what is accepted, queues nothing, and leaves the engine serving the next call."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conveyor.engine.llm import LLM
from conveyor.errors import InvalidRequestError
from conveyor.sampling.params import SamplingParams

GREEDY = SamplingParams(max_tokens=2, temperature=0.0)


@pytest.fixture(scope="module")
def llm(make_engine):
    return LLM(engine=make_engine())


def assert_idle(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    stats = llm.stats()
    assert stats.num_running == stats.num_waiting == 0
    llm.engine.kv.check_invariants(set())   # no request holds a block


@pytest.mark.parametrize("prompts, says", [
    (None, "got NoneType"),
    (5, "got int"),
    (3.5, "got float"),
    (b"hello", "got bytes"),
    ({1, 2}, "got set"),
    ([None], "got NoneType"),
    ([[1, 2], 7], "got int"),
    ([{"text": "x"}], "'prompt' (text) or 'prompt_token_ids'"),
    ([[1, "a"]], "an element 'a'"),
    ([True, False], "got bool"),
])
def test_generate_refuses_malformed_prompts(llm, prompts, says):
    with pytest.raises(InvalidRequestError, match="prompt") as e:
        llm.generate(prompts, GREEDY)
    assert says in str(e.value) and e.value.param == "prompt"
    assert_idle(llm)


@pytest.mark.parametrize("params", [{"temperature": 0}, "greedy", 1])
def test_generate_refuses_malformed_sampling_params(llm, params):
    with pytest.raises(InvalidRequestError, match="SamplingParams"):
        llm.generate("hi", params)
    assert_idle(llm)


@pytest.mark.parametrize("messages", [None, [], "hello", [{"content": "no role"}], [[]], [{"role": 1}]])
def test_chat_refuses_malformed_messages(llm, messages):
    with pytest.raises(InvalidRequestError) as e:
        llm.chat(messages, GREEDY)
    assert e.value.param == "messages"
    assert_idle(llm)


def test_embed_none(llm):
    with pytest.raises(InvalidRequestError, match="got NoneType"):
        llm.embed(None)


def test_accepted_forms_still_run(llm):
    assert llm.generate([], GREEDY) == []
    outs = llm.generate([[1, 2, 3], {"prompt_token_ids": (4, 5), "prompt": "x"}, (6, 7)], GREEDY)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2] * 3
    assert len(llm.generate((9, 10), GREEDY)) == 1   # a tuple of ints is one prompt of token ids
    assert len(llm.generate(([i, i + 1] for i in range(3)), GREEDY)) == 3   # a generator of prompts


junk = st.recursive(st.none() | st.booleans() | st.integers(-5, 300) | st.floats(allow_nan=True)
                    | st.text(max_size=5) | st.binary(max_size=3),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                        st.sampled_from(["prompt", "prompt_token_ids", "cache_salt", "x"]), inner, max_size=2),
                    max_leaves=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=junk)
def test_any_input_is_served_or_refused_cleanly(llm, prompts):
    try:
        outs = llm.generate(prompts, GREEDY)
    except InvalidRequestError:
        pass
    else:
        assert all(o.finished for o in outs)
    assert_idle(llm)
