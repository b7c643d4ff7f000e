import math
import pickle

import pytest

from conveyor.errors import InvalidRequestError
from conveyor.sampling.params import SamplingParams, SamplingType


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, 0, 0.0, 16)
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None
    assert p.sampling_type == SamplingType.RANDOM and not p.needs_penalties


def test_normalization():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(eos_token_ids=[2]).eos_token_ids == (2,)


def test_greedy_and_penalty_flags():
    assert SamplingParams(temperature=0.0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=1e-6).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=1e-3).sampling_type == SamplingType.RANDOM
    assert SamplingParams(presence_penalty=0.5).needs_penalties
    assert SamplingParams(frequency_penalty=-0.5).needs_penalties
    assert SamplingParams(repetition_penalty=1.2).needs_penalties


def test_valid_edges_accepted():
    SamplingParams(n=3, presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=3.0,
                   temperature=0.0, top_p=1.0, top_k=1, min_p=1.0, seed=-5, max_tokens=None,
                   min_tokens=100, logprobs=20, stop_token_ids=[0])
    SamplingParams(temperature=100.0, top_p=1e-9, logprobs=0, max_tokens=1, min_tokens=1)


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=0), "n"),
    (dict(n=1.5), "n"),
    (dict(n=True), "n"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty=math.nan), "presence_penalty"),
    (dict(frequency_penalty=-2.1), "frequency_penalty"),
    (dict(frequency_penalty="1"), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=math.inf), "repetition_penalty"),
    (dict(repetition_penalty=1e-39), "repetition_penalty"),   # subnormal in fp32: logits / it overflow
    (dict(repetition_penalty=1e3), "repetition_penalty"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(temperature=101.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.1), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.0), "top_k"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(seed=1.5), "seed"),
    (dict(seed="42"), "seed"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2.0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=-1), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(stop=["ok", 3]), "stop"),
    (dict(stop=42), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=["a"]), "stop_token_ids"),
    (dict(stop_token_ids=7), "stop_token_ids"),
    (dict(eos_token_ids=(-3,)), "eos_token_ids"),
])
def test_bad_field_names_itself(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} must") as e:
        SamplingParams(**kwargs)
    assert isinstance(e.value, InvalidRequestError) and e.value.param == field and e.value.code is None


@pytest.mark.parametrize("kwargs, field", [
    (dict(stop=["x"] * 65), "stop"),
    (dict(stop=["x" * 257]), "stop"),
    (dict(logit_bias={1: 500.0}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(structured_outputs={"choice": []}), "structured_outputs"),
    (dict(structured_outputs={"regex": "a", "json": {}}), "structured_outputs"),
])
def test_the_field_is_data_not_text(kwargs, field):
    """Front ends read `param` (the server's error body), whatever the message says."""
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == field


def test_errors_pickle_and_rename():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(max_tokens=0)
    again = pickle.loads(pickle.dumps(e.value))
    assert (again.param, str(again)) == ("max_tokens", str(e.value))
    renamed = e.value.renamed("max_completion_tokens")
    assert renamed.param == "max_completion_tokens" and str(renamed).startswith("max_completion_tokens must")


def test_clone_is_deep():
    p = SamplingParams(stop=["x"], stop_token_ids=[1])
    q = p.clone()
    q.stop.append("y")
    q.stop_token_ids.append(2)
    assert p.stop == ["x"] and p.stop_token_ids == [1]
