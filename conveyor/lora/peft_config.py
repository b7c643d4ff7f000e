"""A PEFT LoRA adapter's ``adapter_config.json``, read and checked (torch-free).

Served: plain LoRA on the decoder layers' linear projections (q/k/v/o, gate/up/down) with
``r``, ``lora_alpha``, ``use_rslora``, ``rank_pattern`` and ``alpha_pattern``. Whatever else
changes the forward pass (DoRA and the other LoRA variants, trained biases, modules_to_save,
embedding or LM-head targets) is refused by name, never silently dropped.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# The projections an adapter may adapt (HF names), in the order of the model's fused matmuls.
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Options that change the forward pass when set (truthy), each refused with what it is.
_REFUSED = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "modules_to_save (fully trained modules)",
    "lora_bias": "trained LoRA biases (lora_bias)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows)",
    "target_parameters": "target_parameters (LoRA on raw parameters)",
    "use_qalora": "QALoRA (use_qalora)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "velora_config": "the VeLoRA variant",
    "monteclora_config": "the MonteCLoRA variant",
    "use_bdlora": "the BD-LoRA variant",
    "arrow_config": "Arrow routing",
    "kasa_config": "the KaSA variant",
    "astra_config": "the Astra variant",
}
# Targets that are not decoder-layer projections, by the names models give them.
_NOT_LAYER_TARGETS = {"embed_tokens": "the token embedding", "lm_head": "the LM head", "wte": "the token embedding",
                      "tok_embeddings": "the token embedding", "output": "the LM head"}


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served: what it is and why (the message names it)."""


def refuse(name: str, reason: str) -> LoRAAdapterError:
    return LoRAAdapterError(f"LoRA adapter {name!r}: {reason}")


@dataclass(frozen=True, slots=True)
class PeftLoRAConfig:
    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)    # module-key regex -> its rank
    alpha_pattern: dict[str, float] = field(default_factory=dict)  # module-key regex -> its alpha

    def rank_of(self, key: str) -> int:
        """The rank of the module named `key` (``model.layers.3.self_attn.q_proj``, PEFT's module key)."""
        return self.rank_pattern.get(_pattern_key(self.rank_pattern, key), self.r)

    def scale_of(self, key: str) -> float:
        """What its delta is multiplied by: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        alpha = self.alpha_pattern.get(_pattern_key(self.alpha_pattern, key), self.lora_alpha)
        r = self.rank_of(key)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _pattern_key(patterns: dict, key: str) -> str | None:
    """The first pattern matching the end of `key` at a module boundary (peft's get_pattern_key)."""
    return next((p for p in patterns if re.match(rf"(.*\.)?({p})$", key)), None)


def read_peft_config(directory: str | Path, name: str, max_rank: int) -> PeftLoRAConfig:
    """The adapter's config, checked: a LoRAAdapterError naming adapter `name` for anything not served."""
    path = Path(directory) / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise refuse(name, f"no {CONFIG_FILE} in {str(directory)!r} (not a PEFT adapter directory)") from None
    except (OSError, ValueError) as e:
        raise refuse(name, f"cannot read {path}: {e}") from None
    if not isinstance(raw, dict):
        raise refuse(name, f"{CONFIG_FILE} is not a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise refuse(name, f"peft_type {raw.get('peft_type')!r} is not LORA")
    for key, what in _REFUSED.items():
        if raw.get(key):
            raise refuse(name, f"{what} is not supported")
    if raw.get("bias", "none") != "none":
        raise refuse(name, f"bias={raw['bias']!r} is not supported (only 'none': no trained biases)")
    _check_targets(name, raw.get("target_modules"))
    try:
        r, alpha = int(raw["r"]), float(raw["lora_alpha"])
        ranks = {str(k): int(v) for k, v in (raw.get("rank_pattern") or {}).items()}
        alphas = {str(k): float(v) for k, v in (raw.get("alpha_pattern") or {}).items()}
    except (KeyError, TypeError, ValueError) as e:
        raise refuse(name, f"bad r / lora_alpha / rank_pattern / alpha_pattern in {CONFIG_FILE}: {e!r}") from None
    top = max([r, *ranks.values()])
    if min([r, *ranks.values()]) < 1:
        raise refuse(name, "a rank below 1")
    if top > max_rank:
        raise refuse(name, f"rank {top} exceeds max_lora_rank {max_rank}")
    return PeftLoRAConfig(r, alpha, bool(raw.get("use_rslora")), ranks, alphas)


def _check_targets(name: str, targets) -> None:
    """target_modules names decoder-layer projections only (a list of names, a regex PEFT matches
    against whole module keys, or "all-linear", which leaves out the LM head)."""
    if targets is None or (isinstance(targets, str) and targets.lower() == "all-linear"):
        return
    if isinstance(targets, str):
        hits = [m for m in _NOT_LAYER_TARGETS if re.fullmatch(targets, f"model.{m}") or re.fullmatch(targets, m)]
        if hits:
            raise refuse(name, f"target_modules {targets!r} adapts {_NOT_LAYER_TARGETS[hits[0]]} ({hits[0]}): "
                               f"only decoder-layer projections are supported")
        return
    for t in targets:
        base = str(t).rsplit(".", 1)[-1]
        if base in _NOT_LAYER_TARGETS:
            raise refuse(name, f"target_modules adapts {_NOT_LAYER_TARGETS[base]} ({t}): only decoder-layer "
                               f"projections ({', '.join(MODULES)}) are supported")
        if base not in MODULES:
            raise refuse(name, f"target_modules names {t!r}, not one of the supported projections "
                               f"({', '.join(MODULES)})")
