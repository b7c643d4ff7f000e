"""Speculative decoding on the real demo model (fp32): the same outputs as without it, token for
token (greedy and seeded sampling), under everything that shapes a step -- chunked prefill,
preemption by swap and by recompute, prefix-cache hits, stop strings, stop tokens, logprobs,
penalties, bad words, n > 1 -- and the KV cache whole after every step, with only accepted tokens
ever published to the prefix cache."""

from __future__ import annotations

import pytest

from conveyor import LLM, SamplingParams
from conveyor.kv.events import KVEventRecorder

pytestmark = pytest.mark.slow

# Text the n-gram proposer finds matches in (lists, code, quotes), and one it mostly does not.
PROMPTS = [
    "Repeat exactly: red, green, blue, red, green, blue, red, green, blue, red, green,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Copy this sentence twice. The quick brown fox jumps over the lazy dog. The quick brown fox jumps over",
    "Tell me about the moon.",
]
ALWAYS = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}   # draft at every match


def engine_kwargs(**extra):
    return {"dtype": "float32", "num_kv_blocks": 256, "max_num_seqs": 16, **extra}


@pytest.fixture(scope="module")
def base():
    return LLM(**engine_kwargs())


@pytest.fixture(scope="module")
def spec():
    return LLM(**engine_kwargs(speculative_config=ALWAYS))


def checked(llm: LLM) -> LLM:
    """Check the KV cache's invariants after every step of this engine."""
    core = llm.engine.core
    step = core.step

    def step_and_check():
        updates = step()
        core.scheduler.kv.check_invariants(set(core.scheduler.requests))
        return updates

    core.step = step_and_check
    return llm


def tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_greedy_outputs_equal_without_speculation(base, spec):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want = base.generate(PROMPTS, params)
    checked(spec)
    got = spec.generate(PROMPTS, params)
    assert tokens(got) == tokens(want)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    s = spec.engine.core.scheduler.speculator.stats
    assert s.num_drafts > 0 and 0 < s.num_accepted_tokens < s.num_draft_tokens   # both outcomes happened
    assert spec.engine.core.scheduler.stats.spec_rejected_tokens == s.num_draft_tokens - s.num_accepted_tokens


def test_stop_strings_stop_tokens_max_tokens_logprobs_and_n(base, spec):
    cases = [
        SamplingParams(temperature=0, max_tokens=40, stop=["blue, red"]),            # a stop string inside a draft run
        SamplingParams(temperature=0, max_tokens=7),                                 # max_tokens inside a draft run
        SamplingParams(temperature=0, max_tokens=30, logprobs=3),
        SamplingParams(temperature=0.8, seed=11, max_tokens=30, n=2),               # seeded sampling, n > 1
        SamplingParams(temperature=0, max_tokens=30, frequency_penalty=0.3, repetition_penalty=1.1),
        SamplingParams(temperature=0, max_tokens=30, bad_words=["green"]),      # each position its own history
    ]
    for params in cases:
        want = base.generate(PROMPTS[:3], params)
        got = spec.generate(PROMPTS[:3], params)
        for w, g in zip(want, got):
            for wc, gc in zip(w.outputs, g.outputs):
                # greedy and seeded sampling alike: exactly what it was (a position emits the token
                # the sampler draws there, drafted or not)
                assert (gc.token_ids, gc.text, gc.finish_reason, gc.stop_reason) == \
                       (wc.token_ids, wc.text, wc.finish_reason, wc.stop_reason)
                assert len(gc.token_ids) <= params.max_tokens
                if params.logprobs:
                    assert len(gc.logprobs) == len(gc.token_ids)
                    for wl, gl, t in zip(wc.logprobs, gc.logprobs, gc.token_ids):
                        assert set(gl) == set(wl) and t in gl
                        assert gl[t] == pytest.approx(wl[t], abs=1e-3)
                        assert gl[t].rank == wl[t].rank
    assert spec.engine.core.scheduler.speculator.stats.num_accepted_tokens > 0


def test_stop_token_inside_accepted_drafts_ends_there(base, spec):
    """A stop token id that the drafts would run past: the request ends at its first occurrence."""
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    full = base.generate(PROMPTS[0], params)[0].outputs[0].token_ids
    stop_id = full[12]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, stop_token_ids=[stop_id])
    want = base.generate(PROMPTS[0], params)[0].outputs[0]
    got = spec.generate(PROMPTS[0], params)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.token_ids[-1] == stop_id
    assert got.finish_reason == "stop" and got.stop_reason == stop_id


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_and_chunked_prefill(base, mode):
    """A cache so small that requests preempt each other, a token budget that chunks every prompt."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = base.generate(PROMPTS * 2, params)
    small = checked(LLM(**engine_kwargs(num_kv_blocks=40, block_size=4, preemption_mode=mode,
                                        admission_policy="optimistic", max_num_batched_tokens=24,
                                        speculative_config=ALWAYS)))
    got = small.generate(PROMPTS * 2, params)
    assert tokens(got) == tokens(want)
    stats = small.engine.core.scheduler.stats
    assert stats.num_preemptions > 0 and (stats.num_swaps_out if mode == "swap" else stats.num_recomputes) > 0
    assert small.engine.core.scheduler.speculator.stats.num_accepted_tokens > 0
    kv = small.engine.core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    small.close()


def test_prefix_cache_sees_only_accepted_tokens(base):
    """Every block published to the prefix cache (its KV events) holds tokens of a final sequence at
    that place; a second round of the same prompts hits the cache and gives the same outputs."""
    llm = checked(LLM(**engine_kwargs(block_size=4, speculative_config=ALWAYS)))
    kv = llm.engine.core.scheduler.kv
    recorder = KVEventRecorder(kv.block_size)
    kv.enable_events(recorder)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    sequences = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    blocks = {tuple(seq[i:i + 4]) for seq in sequences for i in range(0, len(seq) - 3, 4)}
    stored = [e for e in recorder.pending if e["type"] == "BlockStored"]
    assert stored
    for event in stored:
        token_ids = event["token_ids"]
        for i in range(0, len(token_ids), 4):
            assert tuple(token_ids[i:i + 4]) in blocks
    assert llm.engine.core.scheduler.speculator.stats.num_draft_tokens > \
        llm.engine.core.scheduler.speculator.stats.num_accepted_tokens   # some drafts were refused
    again = llm.generate(PROMPTS, params)
    assert tokens(again) == tokens(outs) == tokens(base.generate(PROMPTS, params))
    assert llm.engine.core.scheduler.stats.prompt_tokens_cached > 0
    llm.close()


def test_suffix_method_draws_on_earlier_outputs(base):
    """The suffix proposer proposes from finished requests of the same salt: the second of two
    identical requests has (nearly) all its drafts accepted; outputs stay equal."""
    llm = LLM(**engine_kwargs(speculative_config={"method": "suffix", "num_speculative_tokens": 4,
                                                   "adaptive": False}))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = PROMPTS[3]
    first = llm.generate(prompt, params)
    s = llm.engine.core.scheduler.speculator.stats
    before = (s.num_draft_tokens, s.num_accepted_tokens)
    second = llm.generate(prompt, params)
    drafted, accepted = s.num_draft_tokens - before[0], s.num_accepted_tokens - before[1]
    assert tokens(first) == tokens(second) == tokens(base.generate(prompt, params))
    assert drafted > 0 and accepted >= 0.8 * drafted
    llm.close()


LIST_SCHEMA = {"type": "array", "minItems": 3, "maxItems": 4, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "color": {"type": "string", "enum": ["red", "green", "blue"]}},
    "required": ["name", "color"], "additionalProperties": False}}


def test_structured_outputs_speculate_within_their_grammar(base, spec):
    """Drafts of a constrained request are cut to what its grammar takes; each position is masked by
    the grammar advanced through the drafts before it; the output is exactly what it was (greedy and
    seeded), and valid. A JSON list repeats its keys: drafts are accepted."""
    import json

    import jsonschema

    before = spec.engine.core.scheduler.speculator.stats.num_accepted_tokens
    cases = [SamplingParams(temperature=0, max_tokens=120, structured_outputs={"json": LIST_SCHEMA}),
             SamplingParams(temperature=0.7, seed=5, max_tokens=120, structured_outputs={"json": LIST_SCHEMA}),
             SamplingParams(temperature=0, max_tokens=30, structured_outputs={"regex": r"(red|blue)( red| blue){3,8}\."})]
    prompts = ["List three fruits with their colors as JSON:", PROMPTS[0]]
    for params in cases:
        want = base.generate(prompts, params)
        got = spec.generate(prompts, params)
        assert tokens(got) == tokens(want)
        for o in got:
            assert o.outputs[0].finish_reason == "stop"
            if "json" in params.structured_outputs.kind:
                jsonschema.validate(json.loads(o.outputs[0].text), LIST_SCHEMA)
    assert spec.engine.core.scheduler.speculator.stats.num_accepted_tokens > before
