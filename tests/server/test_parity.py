"""vLLM/OpenAI parity fields: logit_bias, allowed_token_ids, bad_words, truncate_prompt_tokens,
cumulative_logprob, per-request chat_template / continue_final_message / chat_template_kwargs,
CORS with --allowed-origins, and vLLM's metric label name."""

from __future__ import annotations

import pytest

from conveyor.engine.llm import LLM
from conveyor.sampling.params import SamplingParams

from conftest import start_server

pytestmark = pytest.mark.slow
GREEDY = dict(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", num_kv_blocks=128, cost_model="none")


def test_logit_bias_allowed_tokens_and_bad_words_offline(llm):
    prompt = "The capital of France is"
    base = llm.generate(prompt, SamplingParams(**GREEDY, logprobs=0), use_tqdm=False)[0].outputs[0]
    first = base.token_ids[0]
    assert base.cumulative_logprob == pytest.approx(sum(e[t] for e, t in zip(base.logprobs, base.token_ids)))
    pushed = llm.generate(prompt, SamplingParams(**GREEDY, logit_bias={42: 100.0}), use_tqdm=False)[0].outputs[0]
    assert pushed.token_ids == [42] * 6
    banned = llm.generate(prompt, SamplingParams(**GREEDY, logit_bias={first: -100.0}), use_tqdm=False)[0].outputs[0]
    assert banned.token_ids[0] != first
    allowed = llm.generate(prompt, SamplingParams(**GREEDY, allowed_token_ids=[100, 200, 300]), use_tqdm=False)
    assert set(allowed[0].outputs[0].token_ids) <= {100, 200, 300}
    word = base.text.split()[0]
    no_word = llm.generate(prompt, SamplingParams(**GREEDY, bad_words=[word]), use_tqdm=False)[0].outputs[0]
    assert word not in no_word.text.split()
    long = "one two three four five six seven eight nine ten"
    cut = llm.generate(long, SamplingParams(**GREEDY, truncate_prompt_tokens=3), use_tqdm=False)[0]
    assert len(cut.prompt_token_ids) == 3 and cut.prompt is None
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 1000.0})
    with pytest.raises(ValueError, match="logit_bias token ids"):
        llm.generate(prompt, SamplingParams(logit_bias={10**9: 1.0}), use_tqdm=False)


def test_parity_fields_over_http(server, client, model_name):
    r = client.completions.create(model=model_name, prompt="Hello", max_tokens=4, temperature=0,
                                  logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    piece = server.http.post("/detokenize", json={"tokens": [42]}).json()["prompt"]
    assert r.choices[0].text == piece * 4
    r = client.completions.create(model=model_name, prompt="one two three four five six", max_tokens=1,
                                  extra_body={"truncate_prompt_tokens": 2})
    assert r.usage.prompt_tokens == 2
    bad = server.http.post("/v1/completions", json={"model": model_name, "prompt": "x", "logit_bias": {"abc": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


def test_chat_template_fields(client, model_name):
    template = "{% for m in messages %}[{{ m['role'] }}|{{ m['content'] }}|{{ flavor }}]{% endfor %}"
    msgs = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hello, my friend"}]
    r = client.chat.completions.create(model=model_name, messages=msgs, max_tokens=3, temperature=0, extra_body={
        "chat_template": template, "chat_template_kwargs": {"flavor": "x"}, "add_generation_prompt": False,
        "continue_final_message": True})
    assert r.usage.prompt_tokens > 0 and r.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(Exception, match="add_generation_prompt"):
        client.chat.completions.create(model=model_name, messages=msgs, max_tokens=3,
                                       extra_body={"continue_final_message": True})


def test_cors_and_vllm_metric_label(demo_model):
    handle = start_server(demo_model, allowed_origins=["https://app.example"])
    try:
        pre = handle.http.options("/v1/completions", headers={"Origin": "https://app.example",
                                                              "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
        handle.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert any(k.startswith("conveyor:request_success_total{finished_reason=") for k in handle.metrics())
    finally:
        handle.stop()
