"""GGUF -> HF-named weights and config: fp32 cached as safetensors (``--quantization none``), or
the Q4_0/Q4_1/Q8_0 matmul weights kept as stored (quant.py), read straight from the file.

llama.cpp stores the Q and K projections of "llama" models with their rows permuted for its
interleaved RoPE; we undo that so that one rotate-half RoPE serves every checkpoint. The
conversion (dequantizing every tensor) is paid once per file: the result is cached under
``$CONVEYOR_CACHE_DIR`` (default ``~/.cache/conveyor``) keyed by the file's size, mtime and
a hash of its header. With quantized weights kept as stored only the config and the tokenizer are
cached there (no dense copy of the weights on disk).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.numpy import save_file

from conveyor.model.config import FULL, SLIDING, ModelConfig, UnsupportedModelError
from conveyor.model.llama import FUSED_PIECE
from conveyor.model.quant import QuantTensor
from conveyor.paths import GGUF_CONVERSION_VERSION, cache_dir, gguf_file_key
from conveyor.tokenizer import Tokenizer

_GGUF_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text",
               "qwen3moe": "qwen3_moe"}
# Only llama.cpp's "llama" graph uses interleaved RoPE with permuted Q/K rows (Mixtral is a "llama"
# file with experts).
_PERMUTED_ARCHS = {"llama", "mistral", "mixtral"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",   # a MoE layer's router
}
# A MoE layer's experts, merged into one 3-D tensor each ([experts, rows, columns]), or (older
# Mixtral files) one tensor per expert, "ffn_gate.E".
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_EXPERT_PIECES = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
# Gemma 3's four norms per layer: "ffn_norm" is the norm before the MLP, as in Llama, but HF names
# that one pre_feedforward_layernorm and the norm of the attention's output post_attention_layernorm.
_GEMMA3_LAYER_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                       "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
SUPPORTED_QUANTS = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(_GGUF_ARCHS)}")
    a = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    heads = a("attention.head_count")
    hidden = a("embedding_length")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise UnsupportedModelError("GGUF with rope_freqs (llama3 RoPE scaling) is not supported yet")
    names = {t.name for t in reader.tensors}
    vocab = a("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    cfg = ModelConfig(
        model_type=_GGUF_ARCHS[arch], vocab_size=vocab, hidden_size=hidden,
        intermediate_size=a("feed_forward_length"), num_hidden_layers=a("block_count"),
        num_attention_heads=heads, num_key_value_heads=a("attention.head_count_kv", heads),
        head_dim=a("attention.key_length", hidden // heads),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(a("rope.freq_base", 10000.0)),
        max_position_embeddings=a("context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names, qk_norm="blk.0.attn_q_norm.weight" in names,
        eos_token_ids=() if eos is None else (int(eos),),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
    )
    if a("expert_count"):
        cfg = _moe_config(cfg, a, names)
    return _gemma3_config(cfg, a) if arch == "gemma3" else cfg


def _moe_config(cfg: ModelConfig, a, names: set[str]) -> ModelConfig:
    """A MoE file: "qwen3moe" (experts of expert_feed_forward_length; the top-k weights renormalized,
    as llama.cpp does for it unless expert_weights_norm says otherwise), or a "llama" file with
    experts, which is Mixtral (experts of feed_forward_length, top-k renormalized). A layer without
    a router (ffn_gate_inp) has a plain MLP."""
    if a("expert_shared_count") or a("expert_shared_feed_forward_length"):
        raise UnsupportedModelError("GGUF with shared experts is not supported")
    if a("expert_gating_func") not in (None, 1):   # llama.cpp: 1 softmax, 2 sigmoid
        raise UnsupportedModelError(f"GGUF expert_gating_func {a('expert_gating_func')} (only softmax) is not supported")
    moe = cfg.model_type == "qwen3_moe"
    width = a("expert_feed_forward_length") if moe else None
    dense = tuple(i for i in range(cfg.num_hidden_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names)
    return replace(cfg, model_type=cfg.model_type if moe else "mixtral", num_experts=int(a("expert_count")),
                   num_experts_per_tok=int(a("expert_used_count", 2)),
                   moe_intermediate_size=int(width or cfg.intermediate_size),
                   norm_topk_prob=bool(a("expert_weights_norm", True)), dense_mlp_layers=dense)


def _gemma3_config(cfg: ModelConfig, a) -> ModelConfig:
    """Gemma 3 as llama.cpp runs it: the sliding-window pattern (every 6th layer global) and the
    local RoPE base (10000) are not in the file; the 27B scales queries by hidden/heads, the others by
    head_dim; a linear RoPE scaling applies to the global layers."""
    scaling = None
    if a("rope.scaling.type") == "linear" and a("rope.scaling.factor"):
        scaling = {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}
    hidden, layers = cfg.hidden_size, cfg.num_hidden_layers
    return replace(
        cfg, rope_theta=float(a("rope.freq_base", 1e6)), max_position_embeddings=a("context_length", 32768),
        qk_norm=True, rope_scaling=scaling, hidden_act="gelu_pytorch_tanh", norm_unit_offset=True, sandwich_norms=True,
        embedding_multiplier=hidden ** 0.5,
        query_pre_attn_scalar=hidden / cfg.num_attention_heads if layers == 62 else cfg.head_dim,
        sliding_window=a("attention.sliding_window"),
        layer_types=tuple(SLIDING if (i + 1) % 6 else FULL for i in range(layers)), rope_local_theta=10000.0)


def _hf_name(gguf_name: str, arch: str = "llama") -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    blk, idx, part = base.split(".", 2)
    layer_names = _GEMMA3_LAYER_NAMES if arch == "gemma3_text" else _LAYER_NAMES
    piece, _, expert = part.partition(".")
    if blk == "blk" and piece in _EXPERT_PIECES and expert.isdigit():   # one expert of an older Mixtral file
        return f"model.layers.{idx}.mlp.experts.{expert}.{_EXPERT_PIECES[piece]}.{suffix}"
    if blk != "blk" or part not in layer_names:
        raise UnsupportedModelError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{idx}.{layer_names[part]}.{suffix}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K row permutation (pairs (2i, 2i+1) -> halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def fused_group_key(hf_name: str) -> str | None:
    """The fused matmul a weight joins (q/k/v -> qkv_proj, gate/up -> gate_up_proj), or None."""
    parts = hf_name.rsplit(".", 2)
    if len(parts) < 3 or parts[1] not in FUSED_PIECE:
        return None
    return f"{parts[0]}.{FUSED_PIECE[parts[1]][0]}.{parts[2]}"


def gguf_tensors(reader, cfg: ModelConfig, native: tuple[str, ...] = (), skip=()):
    """HF-named tensors: fp32 numpy arrays, and, for 2-D weights stored in a type of `native`,
    ``quant.QuantTensor``s of the file's blocks (rows unpermuted like the dense ones). A fused matmul
    (q/k/v, gate/up) with a dense piece is made dense whole by ``loader.build_model``. Names in
    `skip` (HF, without "model.": held elsewhere, model/packed.py) are neither read nor returned."""
    permute = cfg.model_type in _PERMUTED_ARCHS
    out = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in SUPPORTED_QUANTS:
            raise UnsupportedModelError(f"tensor {t.name} uses unsupported GGUF type {kind}")
        if t.name.split(".")[2:3] and t.name.split(".")[2] in _EXPERT_NAMES:
            out.update(_expert_tensors(t, kind, native, skip))
            continue
        name = _hf_name(t.name, cfg.model_type)
        if name.removeprefix("model.") in skip:
            continue
        keep = kind in native and len(t.shape) == 2 and not name.endswith("mlp.gate.weight")   # routers stay dense
        w = np.array(t.data) if keep else np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type),
                                                               dtype=np.float32)
        if cfg.norm_unit_offset and name.endswith("norm.weight"):
            w = w - np.float32(1)   # llama.cpp stores Gemma's (1 + w); HF names hold w
        if permute and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            w = _unpermute(w, cfg.num_attention_heads)
        elif permute and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            w = _unpermute(w, cfg.num_key_value_heads)
        out[name] = QuantTensor(torch.from_numpy(np.ascontiguousarray(w)), kind, int(t.shape[0])) if keep else w
    return out


def _expert_tensors(t, kind: str, native: tuple[str, ...], skip) -> dict:
    """One merged expert tensor (``blk.N.ffn_{gate,up,down}_exps.weight``, [experts, rows, columns])
    as one HF-named weight per expert: QuantTensors of the file's blocks where `kind` is native
    (each expert's rows are contiguous in the file), else fp32 arrays."""
    _, idx, part, _ = t.name.split(".")
    names = [f"model.layers.{idx}.mlp.experts.{e}.{_EXPERT_NAMES[part]}.weight" for e in range(int(t.shape[-1]))]
    wanted = [e for e, n in enumerate(names) if n.removeprefix("model.") not in skip]
    if not wanted:
        return {}
    if kind in native:
        return {names[e]: QuantTensor(torch.from_numpy(np.array(t.data[e])), kind, int(t.shape[0])) for e in wanted}
    dense = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    return {names[e]: np.ascontiguousarray(dense[e]) for e in wanted}


def convert_gguf(path: str | Path, weights: bool = True) -> Path:
    """Convert a GGUF file into a cached HF-style directory: config.json, the tokenizer files (so
    that a cached load does not even parse the GGUF metadata again) and, with `weights`,
    model.safetensors (every tensor dequantized to fp32)."""
    path = Path(path)
    target = cache_dir() / f"{path.stem}-{gguf_file_key(path)}"
    marker = target / "conversion.json"   # written last: its presence means the cache is complete
    meta_marker = target / "metadata.json"   # config and tokenizer only
    if marker.exists() or (not weights and meta_marker.exists()):
        return target
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises assorted errors on a damaged file
        raise UnsupportedModelError(f"cannot read GGUF file {path}: {e}") from e
    cfg = gguf_config(reader)
    target.mkdir(parents=True, exist_ok=True)
    if weights:
        tensors = gguf_tensors(reader, cfg)
        tmp = target / f"model.safetensors.tmp{os.getpid()}"
        save_file(tensors, str(tmp))
        os.replace(tmp, target / "model.safetensors")
    (target / "config.json").write_text(json.dumps(cfg.to_hf(), indent=1))
    if "tokenizer.ggml.model" in reader.fields:
        Tokenizer.from_gguf(reader).save(target)
    done = {"source": str(path.resolve()), "version": GGUF_CONVERSION_VERSION}
    (marker if weights else meta_marker).write_text(json.dumps(done))
    return target


def gguf_native_weights(path: str | Path, cfg: ModelConfig, native: tuple[str, ...], skip=()) -> dict:
    """The file's tensors, HF-named, with the matmul weights of the `native` types as QuantTensors
    and every other tensor as fp32 torch tensors (but those in `skip`: gguf_tensors)."""
    out = gguf_tensors(gguf.GGUFReader(path), cfg, native, skip)
    return {k: torch.from_numpy(v if v.flags.writeable else v.copy()) if isinstance(v, np.ndarray) else v
            for k, v in out.items()}


def gguf_tensor_types(path: str | Path) -> set[str]:
    return {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
