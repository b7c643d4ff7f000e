"""Architecture description of a Llama-family decoder, parsed from HF config.json or GGUF.

Mixture-of-experts variants (Qwen3-MoE, Mixtral) are the same decoder with a routed MLP in some
or all layers: `num_experts` experts of width `moe_intermediate_size`, `num_experts_per_tok` chosen
per token by a softmax router (its top-k weights renormalized where `norm_topk_prob`).

Gemma 3 (text) is the same decoder with switches: GeGLU, RMSNorm weights stored as an offset from
one, norms after attention and after the MLP too, a scaled embedding, and sliding-window layers with
their own RoPE base interleaved with global ones (`layer_types`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# model_type / architectures accepted; all share one decoder with a few switches.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3", "qwen3_moe", "mixtral")
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
SLIDING, FULL = "sliding_attention", "full_attention"


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
    hidden_act: str = "silu"          # the MLP's gate activation (Gemma: gelu_pytorch_tanh)
    norm_unit_offset: bool = False    # HF RMSNorm weights scale by (1 + w) (Gemma); stored as 1 + w here
    sandwich_norms: bool = False      # norms after attention and after the MLP as well (Gemma 3)
    embedding_multiplier: float | None = None   # token embeddings scaled by this (Gemma: sqrt(hidden))
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this) instead of 1/sqrt(head_dim)
    sliding_window: int | None = None           # tokens a sliding-window layer attends to (itself included)
    layer_types: tuple[str, ...] | None = None  # per layer SLIDING or FULL; None: all FULL
    rope_local_theta: float | None = None       # RoPE base of the sliding layers (Gemma 3: 10000)
    num_experts: int = 0                        # > 0: a mixture-of-experts model (routed MLPs)
    num_experts_per_tok: int = 0                # experts each token is routed to (top-k)
    moe_intermediate_size: int = 0              # width of one expert's MLP
    norm_topk_prob: bool = True                 # the top-k routing weights renormalized to sum to 1
    dense_mlp_layers: tuple[int, ...] = ()      # layers of a MoE model with a plain MLP (intermediate_size)

    def layer_is_moe(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.dense_mlp_layers

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, i: int) -> int:
        """Tokens layer `i` attends to (its own included); 0: the whole context."""
        if self.sliding_window and self.layer_types and self.layer_types[i] == SLIDING:
            return self.sliding_window
        return 0

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
        if model_type == "gemma3":   # Gemma3ForConditionalGeneration (4B and up): its text model, no vision
            top = {"tie_word_embeddings": cfg.get("tie_word_embeddings", True), "eos_token_id": cfg.get("eos_token_id"),
                   "bos_token_id": cfg.get("bos_token_id")}
            text = {k: v for k, v in (cfg.get("text_config") or {}).items() if v is not None}
            return cls._from_gemma3({**{k: v for k, v in top.items() if v is not None}, **text})
        if model_type == "gemma3_text":
            return cls._from_gemma3(cfg)
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
        window, types = cls._sliding_layers(cfg, model_type)
        moe = cls._moe_fields(cfg, model_type)
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
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            mlp_bias=cfg.get("mlp_bias", False),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            sliding_window=window, layer_types=types, **moe,
        )

    @staticmethod
    def _moe_fields(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
        """Qwen3-MoE: `num_experts` experts of `moe_intermediate_size`, sparse every
        `decoder_sparse_step`-th layer but those in `mlp_only_layers` (dense, `intermediate_size`),
        `norm_topk_prob` as given. Mixtral: `num_local_experts` in every layer, of
        `intermediate_size`, top-k always renormalized."""
        if model_type not in MOE_MODEL_TYPES:
            return {}
        layers = cfg["num_hidden_layers"]
        if model_type == "mixtral":
            experts, width, norm, dense = cfg.get("num_local_experts", 8), cfg["intermediate_size"], True, ()
        else:
            experts, width = cfg.get("num_experts") or cfg.get("num_local_experts"), cfg["moe_intermediate_size"]
            norm = cfg.get("norm_topk_prob", False)
            step, only = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or ())
            dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
        top_k = cfg.get("num_experts_per_tok", 2)
        if not experts or not 0 < top_k <= experts:
            raise UnsupportedModelError(f"{model_type}: num_experts_per_tok={top_k} with {experts} experts")
        if cfg.get("shared_expert_intermediate_size"):
            raise UnsupportedModelError(f"{model_type} with a shared expert is not supported")
        return {"num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": width,
                "norm_topk_prob": norm, "dense_mlp_layers": dense}

    @staticmethod
    def _sliding_layers(cfg: dict[str, Any], model_type: str) -> tuple[int | None, tuple[str, ...] | None]:
        """Sliding-window attention of a Llama-family config: transformers' `layer_types` where given;
        Mistral's `sliding_window` on every layer; Qwen2's `use_sliding_window` from layer
        `max_window_layers` on. None where no window is shorter than the context."""
        window, layers = cfg.get("sliding_window"), cfg["num_hidden_layers"]
        if not window or window >= cfg.get("max_position_embeddings", 2048):
            return None, None
        if cfg.get("layer_types"):
            types = tuple(cfg["layer_types"])
        elif model_type in ("mistral", "mixtral"):
            types = (SLIDING,) * layers
        elif model_type == "qwen2" and cfg.get("use_sliding_window"):
            start = cfg.get("max_window_layers", layers)
            types = tuple(SLIDING if i >= start else FULL for i in range(layers))
        else:
            return None, None
        return (window, types) if SLIDING in types else (None, None)

    @classmethod
    def _from_gemma3(cls, cfg: dict[str, Any]) -> ModelConfig:
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise UnsupportedModelError(f"unsupported hidden_activation {act!r} for gemma3_text")
        for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(cap) is not None:
                raise UnsupportedModelError(f"gemma3_text with {cap} is not supported")
        layers = cfg["num_hidden_layers"]
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        types = tuple(cfg.get("layer_types") or (
            SLIDING if (i + 1) % pattern else FULL for i in range(layers)))
        # transformers >= 5: rope_parameters per layer type; before: rope_theta (+ rope_scaling) for
        # the global layers and rope_local_base_freq for the sliding ones.
        rope = cfg.get("rope_parameters") or {}
        full = rope.get(FULL) or {"rope_theta": cfg.get("rope_theta", 1e6), **(cfg.get("rope_scaling") or {})}
        local = rope.get(SLIDING) or {"rope_theta": cfg.get("rope_local_base_freq", 1e4)}
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"unsupported rope type {local['rope_type']!r} for the sliding layers")
        scaling = None
        kind = full.get("rope_type", full.get("type", "default"))
        if kind == "linear":
            scaling = {"rope_type": "linear", "factor": full["factor"]}
        elif kind != "default":
            raise UnsupportedModelError(f"unsupported rope type {kind!r} for gemma3_text")
        eos = cfg.get("eos_token_id")
        heads = cfg["num_attention_heads"]
        return cls(
            model_type="gemma3_text", vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads, head_dim=cfg.get("head_dim") or 256,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=full["rope_theta"], rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=cfg.get("tie_word_embeddings", True),
            attention_bias=cfg.get("attention_bias", False), qk_norm=True,
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            bos_token_id=cfg.get("bos_token_id"), hidden_act=act, norm_unit_offset=True, sandwich_norms=True,
            embedding_multiplier=cfg["hidden_size"] ** 0.5,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256),
            sliding_window=cfg.get("sliding_window"), layer_types=types, rope_local_theta=local["rope_theta"],
        )

    def to_hf(self) -> dict[str, Any]:
        """A config.json that transformers loads into an equivalent model."""
        if self.model_type == "gemma3_text":
            return self._to_gemma3()
        archs = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
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
        if self.model_type == "mixtral":
            cfg.update(num_local_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       intermediate_size=self.moe_intermediate_size)
        elif self.model_type == "qwen3_moe":
            cfg.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                       decoder_sparse_step=1, mlp_only_layers=list(self.dense_mlp_layers))
        if self.sliding_window:
            cfg.update(sliding_window=self.sliding_window, layer_types=list(self.layer_types or ()))
        if self.eos_token_ids:
            cfg["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        if self.bos_token_id is not None:
            cfg["bos_token_id"] = self.bos_token_id
        return cfg

    def _to_gemma3(self) -> dict[str, Any]:
        full = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            full = {**self.rope_scaling, "rope_theta": self.rope_theta}
        cfg: dict[str, Any] = {
            "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "hidden_activation": self.hidden_act,
            "attention_bias": self.attention_bias, "query_pre_attn_scalar": self.query_pre_attn_scalar,
            "sliding_window": self.sliding_window, "layer_types": list(self.layer_types or ()),
            "rope_parameters": {FULL: full, SLIDING: {"rope_type": "default", "rope_theta": self.rope_local_theta}},
            "final_logit_softcapping": None, "attn_logit_softcapping": None, "torch_dtype": "float32",
        }
        if self.eos_token_ids:
            cfg["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        if self.bos_token_id is not None:
            cfg["bos_token_id"] = self.bos_token_id
        return cfg
