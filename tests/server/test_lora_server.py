"""LoRA adapters over real HTTP with the official client: --lora-modules, model=<adapter>, adapters and
the base model served concurrently (each equal to transformers + peft), /v1/models listing them,
run-time load/unload, and vllm:lora_requests_info."""

from __future__ import annotations

import asyncio
import copy
import shutil

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import start_server
from conveyor.model.loader import demo_model_path, load_model, model_directory

NEW = 6
ADAPTERS = {"attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"]),
            "all": dict(r=8, lora_alpha=16, target_modules="all-linear", use_rslora=True)}


def tiny_base(directory) -> torch.nn.Module:
    """A tiny random Llama saved as an HF directory, with the demo model's tokenizer files."""
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                                      pad_token_id=None)).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.5)
    hf.save_pretrained(directory)
    for f in model_directory(demo_model_path()).glob("tokenizer*"):
        shutil.copy(f, directory / f.name)
    return hf


def write_adapter(hf: torch.nn.Module, directory, seed: int, **config) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(hf), LoraConfig(init_lora_weights=False, **config)).eval()
    model.save_pretrained(directory)
    return model


def greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def lora_world(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    hf = tiny_base(root / "base")
    peft = {name: write_adapter(hf, root / name, i + 1, **cfg) for i, (name, cfg) in enumerate(ADAPTERS.items())}
    loaded = load_model(str(root / "base"), "cpu", torch.float32)
    server = start_server(loaded, engine_options={"enable_lora": True, "max_loras": 2, "dtype": "float32"},
                          lora_modules=[f"attn={root / 'attn'}"], allow_runtime_lora_updating=True)
    yield server, hf, peft, root
    server.stop()


def test_adapters_by_model_name(lora_world):
    server, hf, peft, root = lora_world
    client = server.openai()
    base = server.engine.model_name
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {base, "attn"}
    assert cards["attn"].root == str(root / "attn") and cards["attn"].model_extra["parent"] == base

    # the runtime routes: one more adapter; a bad path refused; then one unloaded
    r = server.http.post("/v1/load_lora_adapter", json={"lora_name": "all", "lora_path": str(root / "all")})
    assert r.status_code == 200, r.text
    bad = server.http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(root)})
    assert bad.status_code == 400 and "not a PEFT adapter" in bad.json()["error"]["message"]
    taken = server.http.post("/v1/load_lora_adapter", json={"lora_name": "attn", "lora_path": str(root / "all")})
    assert taken.status_code == 400

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 128, (10 + i,), generator=g).tolist() for i in range(6)]
    models = [base, "attn", "all"] * 2
    tok = server.engine.tokenizer

    async def ask():
        aclient = server.async_openai()
        return await asyncio.gather(*(aclient.completions.create(model=m, prompt=p, max_tokens=NEW, temperature=0,
                                                                 extra_body={"ignore_eos": True})
                                      for m, p in zip(models, prompts)))

    for m, p, out in zip(models, prompts, asyncio.run(ask())):
        reference = hf if m == base else peft[m]
        assert out.model == m
        assert out.choices[0].text == tok.decode(greedy(reference, p)), m

    lines = [ln for ln in server.http.get("/metrics").text.splitlines() if ln.startswith("vllm:lora_requests_info")]
    assert len(lines) == 1 and 'max_lora="2"' in lines[0]

    assert server.http.post("/v1/unload_lora_adapter", json={"lora_name": "attn"}).status_code == 200
    assert server.http.post("/v1/unload_lora_adapter", json={"lora_name": "attn"}).status_code == 404
    r = server.http.post("/v1/completions", json={"model": "attn", "prompt": prompts[0], "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert {m.id for m in client.models.list().data} == {base, "all"}
