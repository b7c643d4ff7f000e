"""A PEFT LoRA adapter read into tensors: per decoder layer, per projection, A [r, in] and B [out, r].

The scale (alpha / r, or alpha / sqrt(r) with rsLoRA; per module with alpha_pattern and
rank_pattern) is folded into B once at load, so a delta is two matmuls: (x A^T) B^T. Every
weight must be a decoder-layer projection of the base model with its shapes: anything else is
refused (LoRAAdapterError, naming the adapter and the key).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from conveyor.lora.peft_config import MODULES, WEIGHTS_FILE, PeftLoRAConfig, read_peft_config, refuse
from conveyor.lora.request import LoRARequest

# base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight -> the module key (PEFT's, what
# rank_pattern and alpha_pattern match), layer, parent, projection, A or B.
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)"
                  r"\.(?P<proj>\w+))\.lora_(?P<ab>[AB])\.weight$")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


@dataclass(frozen=True, slots=True)
class BaseShapes:
    """What an adapter must fit: the base model's layer count and each projection's (in, out) features."""
    num_layers: int
    shapes: dict[str, tuple[int, int]]


@dataclass(slots=True)
class LoRAWeights:
    a: torch.Tensor   # [r, in_features]
    b: torch.Tensor   # [out_features, r], the scale folded in


@dataclass(slots=True)
class LoRAAdapter:
    lora: LoRARequest
    rank: int                               # the largest of its modules'
    layers: list[dict[str, LoRAWeights]]    # per decoder layer: projection (MODULES) -> its weights

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for w in layer.values() for t in (w.a, w.b))


def read_adapter(lora: LoRARequest, base: BaseShapes, max_rank: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> LoRAAdapter:
    """Read `lora`'s PEFT directory (adapter_config.json + adapter_model.safetensors), checked against `base`."""
    name, directory = lora.lora_name, Path(lora.lora_path)
    config = read_peft_config(directory, name, max_rank)
    raw = _read_weights(directory, name)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    keys: dict[tuple[int, str], str] = {}
    for key, t in raw.items():
        m = _KEY.match(key)
        if m is None:
            raise refuse(name, f"weight {key!r} is not a LoRA A/B of a decoder-layer projection "
                               f"({', '.join(MODULES)}): not supported")
        layer, proj = int(m["layer"]), m["proj"]
        if _PARENT.get(proj) != m["parent"]:
            raise refuse(name, f"weight {key!r} adapts {m['parent']}.{proj}, which is not supported")
        if layer >= base.num_layers:
            raise refuse(name, f"weight {key!r} is for layer {layer}; the base model has {base.num_layers}")
        pairs.setdefault((layer, proj), {})[m["ab"]] = t
        keys[(layer, proj)] = m["module"]
    if not pairs:
        raise refuse(name, f"{WEIGHTS_FILE} holds no LoRA weights")
    layers: list[dict[str, LoRAWeights]] = [{} for _ in range(base.num_layers)]
    rank = 0
    for (layer, proj), ab in sorted(pairs.items()):
        w = _module(name, keys[(layer, proj)], ab, base.shapes[proj], config, max_rank)
        layers[layer][proj] = LoRAWeights(w.a.to(device=device, dtype=dtype).contiguous(),
                                          w.b.to(device=device, dtype=dtype).contiguous())
        rank = max(rank, w.a.shape[0])
    return LoRAAdapter(lora, rank, layers)


def _read_weights(directory: Path, name: str) -> dict[str, torch.Tensor]:
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        found = " (found adapter_model.bin: only safetensors adapters are read)" \
            if (directory / "adapter_model.bin").is_file() else ""
        raise refuse(name, f"no {WEIGHTS_FILE} in {str(directory)!r}{found}")
    try:
        return load_file(path, device="cpu")
    except (OSError, SafetensorError) as e:
        raise refuse(name, f"cannot read {path}: {e}") from None


def _module(name: str, key: str, ab: dict[str, torch.Tensor], shape: tuple[int, int], config: PeftLoRAConfig,
            max_rank: int) -> LoRAWeights:
    """One projection's A and B, checked against the base shape (in, out) and the config's rank; B scaled."""
    if ab.keys() != {"A", "B"}:
        raise refuse(name, f"{key} has lora_{''.join(ab)} without its lora_{'B' if 'A' in ab else 'A'}")
    a, b = ab["A"], ab["B"]
    n_in, n_out = shape
    r = a.shape[0] if a.dim() == 2 else -1
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != n_in or b.shape != (n_out, r):
        raise refuse(name, f"{key}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the base "
                           f"model's projection ({n_in} -> {n_out} features): expected [r, {n_in}] and [{n_out}, r] "
                           f"(an adapter for another model?)")
    if r > max_rank:
        raise refuse(name, f"{key} has rank {r}, above max_lora_rank {max_rank}")
    if r != config.rank_of(key):
        raise refuse(name, f"{key} has rank {r}, its config says {config.rank_of(key)}")
    return LoRAWeights(a.float(), b.float() * config.scale_of(key))
