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


def test_chat_template_flag_reads_a_file_or_text(tmp_path):
    from conveyor.server.cli import read_chat_template

    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}")
    assert read_chat_template(str(f)) == "{{ messages[0]['content'] }}"
    assert read_chat_template("{{ 1 }}") == "{{ 1 }}"
    with pytest.raises(SystemExit, match="no such file"):
        read_chat_template("missing.jinja")


def test_logits_processors_detokenize_and_logprob_objects(llm):
    def only_even(output_ids, row):
        row[1::2] = float("-inf")
        return row

    out = llm.generate("Hello", SamplingParams(**GREEDY, logits_processors=[only_even], logprobs=2,
                                               detokenize=False), use_tqdm=False)[0].outputs[0]
    assert all(t % 2 == 0 for t in out.token_ids) and out.text == ""
    entry = out.logprobs[0][out.token_ids[0]]
    assert entry.logprob == float(entry) and entry.rank == 1 and isinstance(entry.decoded_token, str)
    import pickle

    again = pickle.loads(pickle.dumps(out.logprobs[0]))
    assert again[out.token_ids[0]].rank == 1 and again == out.logprobs[0]


def test_tokenizer_option(tmp_path):
    from conveyor.config import EngineConfig
    from conveyor.model.loader import demo_model_path, model_directory

    with pytest.raises(Exception, match="does not exist"):
        LLM(tokenizer=str(tmp_path / "nope"), dtype="float32", num_kv_blocks=16)
    llm = LLM(tokenizer=str(model_directory(demo_model_path())), dtype="float32", num_kv_blocks=16)
    assert llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    assert EngineConfig.from_options(tokenizer="x").tokenizer == "x"


def test_best_of_returns_the_most_likely_samples(llm, client, model_name):
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    every = llm.generate("Once upon a time", SamplingParams(**{**_fields(sampled), "n": 4, "logprobs": 0}),
                         use_tqdm=False)[0].outputs
    best = llm.generate("Once upon a time", SamplingParams(**{**_fields(sampled), "n": 2, "best_of": 4}),
                        use_tqdm=False)[0].outputs
    ranked = sorted(every, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked] and [c.index for c in best] == [0, 1]
    assert best[0].logprobs is None   # computed to rank, not asked for
    r = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=8, n=1, best_of=3,
                                  temperature=1.0, seed=5)
    assert len(r.choices) == 1 and r.usage.completion_tokens <= 3 * 8
    with pytest.raises(Exception, match="best_of"):
        client.completions.create(model=model_name, prompt="x", max_tokens=2, best_of=3, stream=True)


def _fields(p: SamplingParams) -> dict:
    return {k: getattr(p, k) for k in ("max_tokens", "temperature", "seed", "ignore_eos")}
