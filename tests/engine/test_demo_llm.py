"""The offline API on the real demo model (slow: loads SmolLM2-135M)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conveyor import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "List three colors:",
           "The quick brown fox", "In 1492, Columbus"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=16, num_kv_blocks=256, dtype="float32")   # correctness in fp32


@pytest.fixture(scope="module")
def reference(llm):
    return [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


def test_generate_in_input_order_and_matches_alone(llm, reference):
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.prompt for o in outs] == PROMPTS
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert all(o.outputs[0].finish_reason == "length" and o.metrics[0].ttft is not None for o in outs)
    assert "Paris" in outs[1].outputs[0].text


# recompute on the demo model is heavy (CI time): tests/model/test_bitwise_invariance.py checks it on tiny GGUFs
@pytest.mark.parametrize("mode", ["swap", pytest.param("recompute", marks=pytest.mark.heavy)])
def test_preemption_on_the_demo_model(reference, mode):
    # 12 blocks of 4 tokens for 6 prompts of ~5 tokens + 24 outputs: forces preemption.
    small = LLM(num_kv_blocks=12, block_size=4, preemption_mode=mode, admission_policy="optimistic", dtype="float32",
                min_resident_steps=1)
    outs = small.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    stats = small.stats()
    assert stats.num_preemptions > 0
    assert (stats.num_swaps_out if mode == "swap" else stats.num_recomputes) > 0
    assert stats.kv_usage == 0.0


def test_stop_string_and_chat(llm):
    (out,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=40))
    text = out.outputs[0].text
    assert "Paris" in text and out.outputs[0].finish_reason == "stop"
    word = text.split()[1]   # a stop string in the middle of the greedy answer, spanning tokens maybe
    (cut,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=40, stop=[word]))
    c = cut.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == word
    assert c.text == text[:text.index(word)]
    (incl,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0, max_tokens=40, stop=[word], include_stop_str_in_output=True))
    assert incl.outputs[0].text == text[:text.index(word) + len(word)]


def test_logprobs_and_seeded_sampling(llm):
    p = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=123, logprobs=3)
    a, b = llm.generate(["Hello, my name is", "Hello, my name is"], [p, p], use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    lps = a.outputs[0].logprobs
    assert len(lps) == len(a.outputs[0].token_ids)
    for tok, lp in zip(a.outputs[0].token_ids, lps):
        assert tok in lp and len(lp) >= 3 and all(v <= 0 for v in lp.values())


def test_cli_generate_reads_a_file(tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text(json.dumps({"prompt": "The capital of France is"}) + "\n" + "Once upon a time\n")
    res = subprocess.run([sys.executable, "-m", "conveyor", "generate", "--file", str(f), "--max-tokens", "8",
                          "--json", "--num-kv-blocks", "64"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["The capital of France is", "Once upon a time"]
    assert "Paris" in rows[0]["text"] and all(len(r["token_ids"]) <= 8 for r in rows)


def test_cli_errors_are_clear(tmp_path):
    res = subprocess.run([sys.executable, "-m", "conveyor", "generate", "--model", str(tmp_path / "nope"), "hi"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "does not exist" in res.stderr


def test_bfloat16_runs_and_agrees_on_the_first_tokens(reference):
    """bf16 (the portable torch path) is not bit-equal to fp32; the first greedy tokens of these
    prompts win by wide margins, so they must agree."""
    bf16 = LLM(dtype="bfloat16", num_kv_blocks=64)
    outs = bf16.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids[:3] for o in outs] == [r[:3] for r in reference[:2]]
