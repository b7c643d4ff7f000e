"""lm-evaluation-harness (`local-completions`, remote tokenizer) runs a small local multiple-choice
task against the server, and its loglikelihoods equal Conveyor's offline prompt logprobs."""

from __future__ import annotations

import json
import math

import pytest

pytestmark = pytest.mark.slow

QUESTIONS = [
    ("The capital of France is", [" Paris", " Rome", " Berlin"], 0),
    ("Two plus two equals", [" four", " seven", " blue"], 0),
    ("The color of the clear sky is", [" green", " blue", " loud"], 1),
    ("Water freezes at zero degrees", [" Celsius", " Fahrenheit", " Kelvin"], 0),
]

TASK = """task: conveyor_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""


def test_lm_eval_multiple_choice_matches_offline_logprobs(server, model_name, demo_model, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from conveyor.engine.engine import Engine, EngineConfig
    from conveyor.sampling.params import SamplingParams

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (tmp_path / "conveyor_mc.yaml").write_text(TASK.format(data=data))
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"base_url={server.url}/v1/completions,model={model_name},tokenizer_backend=remote,"
                   f"num_concurrent=1,max_retries=1,tokenized_requests=True",
        tasks=["conveyor_mc"], task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True)
    samples = results["samples"]["conveyor_mc"]
    assert len(samples) == len(QUESTIONS) and 0.0 <= results["results"]["conveyor_mc"]["acc,none"] <= 1.0

    engine = Engine(EngineConfig.from_options(num_kv_blocks=64, cost_model="none"), loaded=demo_model)
    tok = engine.tokenizer

    def offline_loglikelihood(context: str, continuation: str) -> float:
        ctx = tok.encode(context, add_special_tokens=False)
        whole = ctx + tok.encode(continuation, add_special_tokens=False)
        rid = engine.add_request({"prompt_token_ids": whole}, SamplingParams(max_tokens=1, prompt_logprobs=0))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id == rid:
                    return sum(e[t] for e, t in zip(out.prompt_logprobs[len(ctx):], whole[len(ctx):]))
        raise AssertionError("no output")

    checked = 0
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        q, choices, _ = QUESTIONS[s["doc_id"]]
        for choice, resp in zip(choices, s["resps"]):
            loglik = resp[0][0]
            assert math.isclose(loglik, offline_loglikelihood(q, choice), abs_tol=1e-3), (q, choice)
            checked += 1
    assert checked == sum(len(c) for _, c, _ in QUESTIONS)
