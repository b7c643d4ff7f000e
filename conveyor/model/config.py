"""Architecture description of a Llama-family decoder, parsed from HF config.json or GGUF."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# model_type / architectures accepted; all share one decoder with a few switches.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModelError(ValueError):
    """The checkpoint describes an architecture Conveyor cannot run."""


@dataclass(slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False      # q/k/v biases (Qwen2, some Llamas)
    qk_norm: bool = False             # per-head RMSNorm on q and k (Qwen3)
    mlp_bias: bool = False
    eos_token_ids: tuple[int, ...] = field(default=())
    bos_token_id: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        return 2 * self.num_hidden_layers * self.kv_size * dtype_bytes

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            arch = cfg.get("architectures") or [model_type or "unknown"]
            raise UnsupportedModelError(
                f"unsupported architecture {arch[0]!r} (model_type={model_type!r}); "
                f"Conveyor supports model_type in {SUPPORTED_MODEL_TYPES}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {cfg['hidden_act']!r}")
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}  # transformers >= 5 folds theta/scaling here
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind not in ("llama3", "linear", "default"):
                raise UnsupportedModelError(f"unsupported rope_scaling type {kind!r}")
            scaling = None if kind == "default" else dict(scaling, rope_type=kind)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=model_type == "qwen2" or cfg.get("attention_bias", False),
            qk_norm=model_type == "qwen3",
            mlp_bias=cfg.get("mlp_bias", False),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )

    def to_hf(self) -> dict[str, Any]:
        """A config.json that transformers loads into an equivalent model."""
        archs = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
        cfg: dict[str, Any] = {
            "architectures": [archs[self.model_type]], "model_type": self.model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "hidden_act": "silu",
            "attention_bias": self.attention_bias, "mlp_bias": self.mlp_bias,
            "torch_dtype": "float32",
        }
        if self.rope_scaling:
            cfg["rope_scaling"] = self.rope_scaling
        if self.eos_token_ids:
            cfg["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        if self.bos_token_id is not None:
            cfg["bos_token_id"] = self.bos_token_id
        return cfg
