"""Structured outputs offline (LLM + SamplingParams(structured_outputs=...)): outputs always match
the constraint, for sampled n > 1, through preemption of both kinds; bad constraints are
ValueErrors that queue nothing; compiled grammars are cached."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from conveyor.engine.llm import LLM
from conveyor.sampling.params import SamplingParams
from conveyor.sampling.structured import StructuredOutputsParams

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                           "rank": {"type": "integer", "minimum": 1, "maximum": 99}},
          "required": ["city", "rank"], "additionalProperties": False}
PROMPTS = ["A city and its rank:", "Name a place:", "JSON please:", "Tell me about Rome.", "Rank a town:",
           "Where?"]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=16, num_kv_blocks=256, dtype="float32")


def test_constraint_kinds_hold_for_sampled_outputs(llm):
    params = SamplingParams(max_tokens=60, temperature=1.2, seed=7, n=3,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        for c in out.outputs:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.text), SCHEMA)
    choice = SamplingParams(max_tokens=8, temperature=1.5, seed=1, n=4, structured_outputs={"choice": ["red", "green"]})
    assert {c.text for o in llm.generate(PROMPTS, choice, use_tqdm=False) for c in o.outputs} <= {"red", "green"}
    regex = SamplingParams(max_tokens=20, temperature=1.0, seed=2, structured_outputs={"regex": r"[a-z]{2,5}!"})
    assert all(re.fullmatch(r"[a-z]{2,5}!", o.outputs[0].text) for o in llm.generate(PROMPTS, regex, use_tqdm=False))


def test_unconstrained_requests_in_the_same_batch_are_unchanged(llm):
    plain = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain, use_tqdm=False)]
    constrained = SamplingParams(max_tokens=40, temperature=0, structured_outputs={"json": SCHEMA})
    mixed = llm.generate(PROMPTS + PROMPTS, [plain] * len(PROMPTS) + [constrained] * len(PROMPTS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:len(PROMPTS)]] == alone


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_keeps_the_grammar_state(llm, mode):
    params = SamplingParams(max_tokens=40, temperature=0, structured_outputs={"json": SCHEMA})
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    small = LLM(num_kv_blocks=14, block_size=4, preemption_mode=mode, admission_policy="optimistic",
                dtype="float32", min_resident_steps=1)
    outs = small.generate(PROMPTS, params, use_tqdm=False)
    assert small.stats().num_preemptions > 0
    assert [o.outputs[0].text for o in outs] == want
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)


def test_bad_constraints_raise_and_queue_nothing(llm):
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs={})
    with pytest.raises(ValueError, match="regex"):
        llm.generate("hi", SamplingParams(structured_outputs={"regex": "(unclosed"}), use_tqdm=False)
    with pytest.raises(ValueError, match="grammar"):
        llm.generate("hi", SamplingParams(structured_outputs={"grammar": "start: undefined_rule"}), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    compiles = llm.engine.grammars.compiles
    out = llm.generate(["a", "b"], SamplingParams(max_tokens=5, structured_outputs={"choice": ["yes", "no"]}),
                       use_tqdm=False)
    out += llm.generate(["c"], SamplingParams(max_tokens=5, structured_outputs={"choice": ["yes", "no"]}),
                        use_tqdm=False)
    assert all(o.outputs[0].text in ("yes", "no") for o in out)
    assert llm.engine.grammars.compiles == compiles + 1   # one compile, then the cache
