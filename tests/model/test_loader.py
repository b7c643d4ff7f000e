"""Loading checkpoints: clear errors for bad input, sharded safetensors, GGUF conversion and its cache."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import gguf
import gguf.quants
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from conveyor.model.config import ModelConfig, UnsupportedModelError
from conveyor.model.gguf_loader import convert_gguf
from conveyor.model.loader import ModelNotFoundError, build_model, load_model, load_weights, read_config
from conveyor.model.loader import resolve_model_path
from model_testlib import conveyor_prompt_logits, logit_atol, make_hf_model, random_prompts

# ---------------------------------------------------------------------------------------------
# Missing or unsupported models


def test_missing_model_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model_path(missing)
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        load_model(missing)
    with pytest.raises(ModelNotFoundError):
        load_model(str(tmp_path / "missing.gguf"))


def _write_config(directory: Path, **cfg) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


def test_unsupported_architecture_is_named(tmp_path):
    d = _write_config(tmp_path / "gpt2", model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=10,
                      n_embd=8)
    with pytest.raises(UnsupportedModelError) as err:
        read_config(d)
    msg = str(err.value)
    assert "GPT2LMHeadModel" in msg and "gpt2" in msg
    assert all(t in msg for t in ("llama", "mistral", "qwen2", "qwen3"))   # says what is supported
    # Through the public entry point too, before anything else (e.g. the tokenizer) is touched.
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model(d)


@pytest.mark.parametrize("override, needle", [
    (dict(hidden_act="gelu"), "gelu"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}), "yarn"),
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "dynamic"),
])
def test_unsupported_variants_are_named(override, needle):
    cfg = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, **override)
    with pytest.raises(UnsupportedModelError, match=needle):
        ModelConfig.from_hf(cfg)


def test_directory_without_config_or_weights(tmp_path):
    with pytest.raises(UnsupportedModelError, match="config.json"):
        read_config(tmp_path)
    with pytest.raises(UnsupportedModelError, match="safetensors"):
        load_weights(tmp_path)


# ---------------------------------------------------------------------------------------------
# Corrupt or inconsistent safetensors


def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_safetensors(tiny_models, tmp_path, damage):
    d = _copy_model(tiny_models("llama_gqa").path, tmp_path / "m")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"garbage": os.urandom(4096), "truncated": data[:len(data) // 2], "empty": b""}[damage])
    with pytest.raises(UnsupportedModelError, match="model.safetensors"):
        load_weights(d)


def test_missing_and_misshapen_weights(tiny_models, tmp_path):
    fam = tiny_models("llama_gqa")
    weights = load_weights(fam.path)
    partial = {k: v for k, v in weights.items() if k != "model.layers.1.self_attn.v_proj.weight"}
    with pytest.raises(ValueError, match="layers.1.self_attn"):
        build_model(fam.cfg, partial)
    partial = {k: v for k, v in weights.items() if k != "model.layers.0.post_attention_layernorm.weight"}
    with pytest.raises(ValueError, match="post_attention_layernorm"):
        build_model(fam.cfg, partial)
    bad = dict(weights, **{"model.norm.weight": torch.ones(32)})
    with pytest.raises(ValueError, match="model.norm.weight|norm.weight"):
        build_model(fam.cfg, bad)


def test_sharded_safetensors_load_the_same_weights(tiny_models, tmp_path):
    fam = tiny_models("qwen2")
    fam.hf.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tmp_path / "model.safetensors").exists()
    single, sharded = load_weights(fam.path), load_weights(tmp_path)
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[k], sharded[k]) for k in single)
    # A stray file that the index does not list is not loaded.
    save_file({"junk": torch.zeros(1)}, str(tmp_path / "zz-unrelated.safetensors"))
    assert load_weights(tmp_path).keys() == single.keys()
    # A shard named by the index but missing is reported by name.
    missing = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / missing).unlink()
    with pytest.raises(UnsupportedModelError, match=missing):
        load_weights(tmp_path)


# ---------------------------------------------------------------------------------------------
# GGUF


@pytest.mark.parametrize("damage", ["garbage", "empty", "magic-only", "truncated"])
def test_corrupt_gguf(tmp_path, monkeypatch, damage):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "broken.gguf"
    if damage == "truncated":
        good = _write_tiny_gguf(make_hf_model("llama_gqa"), tmp_path / "good.gguf", "llama")
        data = good.read_bytes()
        path.write_bytes(data[:len(data) * 2 // 3])
    else:
        path.write_bytes({"garbage": os.urandom(5000), "empty": b"",
                          "magic-only": b"GGUF" + os.urandom(64)}[damage])
    with pytest.raises(UnsupportedModelError, match="broken.gguf"):
        convert_gguf(path)
    with pytest.raises(UnsupportedModelError):
        load_model(path)
    assert not any((tmp_path / "cache").glob("*/model.safetensors"))   # nothing half-written is cached


def test_gguf_unsupported_architecture(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        convert_gguf(tmp_path / "gpt2.gguf")


# A tiny GGUF written the way llama.cpp's convert_hf_to_gguf.py writes one (F32 tensors).
_GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp"}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: rotate-half rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf_name]
    _, _, idx, rest = hf_name.split(".", 3)
    module, _, suffix = rest.rpartition(".")
    return f"blk.{idx}.{_GGUF_LAYER[module]}.{suffix}"


def _gguf_arrays(hf_model, arch: str, names=None):
    """(GGUF name, fp32 array) of each tensor of the model's state dict (a tied LM head left out),
    Q/K rows permuted as llama.cpp does for its "llama" graph. `names`: which state-dict entries
    (default: all)."""
    c = hf_model.config
    for name, t in hf_model.state_dict().items():
        if (name == "lm_head.weight" and c.tie_word_embeddings) or (names is not None and name not in names):
            continue
        a = t.detach().float().numpy().copy()
        if arch == "llama" and ".q_proj." in name:
            a = _llama_cpp_permute(a, c.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            a = _llama_cpp_permute(a, c.num_key_value_heads)
        yield _gguf_name(name), a


def _write_tiny_gguf(hf_model, path: Path, arch: str, add_tensor=None, tensors=None, metadata=None) -> Path:
    """`add_tensor(writer, gguf_name, fp32 array)`: how each tensor is stored (default: F32).
    `tensors`: GGUF-named fp32 arrays to write instead of the model's state dict (each renamed and,
    for "llama", its Q/K rows permuted); `metadata(writer)`: keys beyond the common ones."""
    c = hf_model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    if metadata is not None:
        metadata(w)
    for name, a in (_gguf_arrays(hf_model, arch) if tensors is None else tensors.items()):
        if add_tensor is None:
            w.add_tensor(name, a)
        else:
            add_tensor(w, name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("name, arch", [("llama_gqa", "llama"), ("llama_tied", "llama"), ("qwen2", "qwen2"),
                                        ("qwen3", "qwen3")])
def test_gguf_round_trip_matches_hf(tiny_models, tmp_path, monkeypatch, name, arch):
    """GGUF (Q/K rows permuted as llama.cpp does for "llama") -> convert_gguf -> same logits as HF."""
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    fam = tiny_models(name)
    directory = convert_gguf(_write_tiny_gguf(fam.hf, tmp_path / f"{name}.gguf", arch))
    assert directory.parent == tmp_path / "cache"
    cfg = read_config(directory)
    for field in ("model_type", "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
                  "attention_bias", "qk_norm", "rope_theta", "rms_norm_eps", "max_position_embeddings"):
        assert getattr(cfg, field) == pytest.approx(getattr(fam.cfg, field)), field
    model = build_model(cfg, load_weights(directory))
    prompts = random_prompts([1, 9, 40], seed=4)
    for prompt, got in zip(prompts, conveyor_prompt_logits(model, prompts, chunk=16)):
        with torch.inference_mode():
            want = fam.hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(got, want, rtol=0, atol=logit_atol(want))


def _count_dequantize(monkeypatch) -> list[int]:
    calls = [0]
    real = gguf.quants.dequantize

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(gguf.quants, "dequantize", counting)
    return calls


def test_gguf_conversion_is_cached(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    src = _write_tiny_gguf(tiny_models("llama_gqa").hf, tmp_path / "tiny.gguf", "llama")
    calls = _count_dequantize(monkeypatch)
    first = convert_gguf(src)
    assert calls[0] > 0
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    calls[0] = 0
    assert convert_gguf(src) == first and calls[0] == 0
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    # A rewritten file (new mtime) is converted again, into its own directory.
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert convert_gguf(src) != first and calls[0] > 0


@pytest.mark.slow
def test_demo_gguf_conversion_is_cached(tmp_path, monkeypatch):
    from conveyor.model.loader import demo_model_path

    try:
        demo = demo_model_path()
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    calls = _count_dequantize(monkeypatch)
    first = convert_gguf(demo)
    assert first.parent == tmp_path and calls[0] > 0
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    calls[0] = 0
    assert convert_gguf(demo) == first
    assert calls[0] == 0 and (first / "model.safetensors").stat().st_mtime_ns == stamp
