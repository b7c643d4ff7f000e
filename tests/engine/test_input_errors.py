"""Input validation names the parameter at fault as data (``param``, ``code``), not only in its message."""

from __future__ import annotations

import pytest

from conveyor.frontend.inputs import InputProcessor, cache_salt_of, token_id_list, validate_request
from conveyor.errors import InvalidRequestError
from conveyor.sampling.params import SamplingParams

VOCAB, CONTEXT = 100, 16


@pytest.mark.parametrize("ids, params, param, code", [
    ([], SamplingParams(), "prompt", None),
    ([5, 100], SamplingParams(), "prompt", None),
    ([1] * CONTEXT, SamplingParams(), "prompt", "context_length_exceeded"),
    ([1], SamplingParams(logit_bias={100: 1.0}), "logit_bias", None),
    ([1], SamplingParams(allowed_token_ids=[3, 1000]), "allowed_token_ids", None),
])
def test_validate_request_names_the_parameter(ids, params, param, code):
    with pytest.raises(InvalidRequestError) as e:
        validate_request(ids, params, VOCAB, CONTEXT)
    assert (e.value.param, e.value.code) == (param, code)


@pytest.mark.parametrize("ids", [3, [1, 2.0], [True], "12"])
def test_token_ids_are_the_prompt(ids):
    with pytest.raises(InvalidRequestError) as e:
        token_id_list(ids)
    assert e.value.param == "prompt"


@pytest.mark.parametrize("salt", ["", 5])
def test_cache_salt(salt):
    with pytest.raises(ValueError) as e:   # still a ValueError for callers that catch those
        cache_salt_of({"prompt": "x", "cache_salt": salt})
    assert e.value.param == "cache_salt"
    assert cache_salt_of({"prompt": "x"}) is None and cache_salt_of({"prompt": "x", "cache_salt": "a"}) == "a"
    assert cache_salt_of([1, 2], "b") == "b"


def test_params_changed_after_construction_are_checked_again():
    """SamplingParams validate when built; a field set later is checked when the request is processed,
    not left for the engine process to refuse (where decoding it would fail the whole pipe)."""
    params = SamplingParams(max_tokens=4)
    params.max_tokens = 0
    with pytest.raises(InvalidRequestError) as e:
        InputProcessor(None, VOCAB, CONTEXT, [0]).process([1, 2], params)
    assert e.value.param == "max_tokens"
