"""Offline, the model's default sampling parameters are what ``LLM.generate`` uses when given none (vLLM's
``LLM(generation_config=...)`` and ``get_default_sampling_params()``); given SamplingParams are used as they
are; a bad setting stops the engine before it starts."""

from __future__ import annotations

import logging

import pytest

from conveyor import LLM, SamplingParams


def test_generate_without_params_uses_the_models_defaults(make_engine, caplog):
    with caplog.at_level(logging.INFO, logger="conveyor.engine.engine"):
        llm = LLM(engine=make_engine(override_generation_config={"temperature": 0, "max_tokens": 3}))
    assert "default sampling parameters from overrides: temperature=0, max_tokens=3" in caplog.text
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens, defaults.top_p) == (0, 3, 1.0)
    prompt = [5, 6, 7, 8]
    (plain,) = llm.generate(prompt)
    (greedy,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert plain.outputs[0].token_ids == greedy.outputs[0].token_ids and len(greedy.outputs[0].token_ids) == 3
    # SamplingParams given are taken whole: their max_tokens, not the default's
    (given,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(given.outputs[0].token_ids) == 6 and given.outputs[0].token_ids[:3] == greedy.outputs[0].token_ids


def test_a_model_without_defaults_keeps_the_neutral_ones(make_engine, caplog):
    with caplog.at_level(logging.INFO, logger="conveyor.engine.engine"):
        llm = LLM(engine=make_engine())   # the tiny test model: no generation config anywhere
    assert llm.engine.generation_defaults == {} and "default sampling parameters: none" in caplog.text
    assert llm.get_default_sampling_params() == SamplingParams()
    llm = LLM(engine=make_engine(generation_config="vllm", override_generation_config='{"top_k": 5}'))
    assert llm.engine.generation_defaults == {"top_k": 5}


@pytest.mark.parametrize("options, message", [
    ({"override_generation_config": '{"temperature": -0.5}'}, "temperature must be in"),
    ({"override_generation_config": '{"beams": 2}'}, "unknown field"),
    ({"generation_config": "/nonexistent/folder"}, "no such file or folder"),
])
def test_a_bad_setting_is_refused_at_start(make_engine, options, message):
    with pytest.raises(ValueError, match=message):
        make_engine(**options)
