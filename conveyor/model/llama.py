"""Llama-family decoder (Llama 2/3, Mistral, SmolLM2, Qwen2, Qwen3, Gemma 3; Qwen3-MoE and Mixtral
with routed experts) on a flattened token batch.

Every op except attention runs on all tokens of the step at once (Orca's selective batching);
attention uses the per-sequence metadata. Q/K/V and gate/up projections are fused into one
matmul each to cut per-step kernel launches and Python overhead.
"""

from __future__ import annotations

import math
from itertools import repeat
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.model.attention import AttentionBackend, AttentionMetadata, CpuPagedAttention, TorchPagedAttention
from conveyor.model.config import ModelConfig
from conveyor.model.cpu_kernels import load_cpu_kernels
from conveyor.model.linear import MAX_GEMV_TOKENS, CpuLinear, replace_linears
from conveyor.model.ops import CpuFusedOps, TorchOps
from conveyor.model.quant import (NATIVE_BLOCK_BYTES, QuantConcat, QuantEmbedding, QuantLinear, QuantTensor, dense_module,
                                  dense_tokens, int8_amx_tokens)

if TYPE_CHECKING:
    from conveyor.model.lora import LayerLoRA, LoRABatch
    from conveyor.model.packed import PackedWeights


# The matmuls fused on load: fused module -> the HF pieces whose rows it stacks, in order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
FUSED_PIECE = {piece: (fused, i) for fused, pieces in FUSED.items() for i, piece in enumerate(pieces)}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: TorchOps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += x (in place); returns the norm of the new residual."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies of the global layers' RoPE, or (`local`) of the sliding-window layers'
    (their own base, no scaling: Gemma 3)."""
    dim = cfg.head_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = {} if local else (cfg.rope_scaling or {})
    kind = scaling.get("rope_type")
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    """Non-interleaved ("rotate half") RoPE, the layout of HF checkpoints."""

    def __init__(self, cfg: ModelConfig, ops: TorchOps, local: bool = False):
        super().__init__()
        self.cfg = cfg
        self.ops = ops
        self.local = local
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset()

    def reset(self) -> None:
        """(Re)compute the tables, e.g. after the module was built on the meta device."""
        device = self.cos.device if self.cos.device.type != "meta" else None
        t = torch.arange(self.cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, rope_inv_freq(self.cfg, self.local))
        self.cos, self.sin = freqs.cos().to(device), freqs.sin().to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Tables stay fp32; the torch path casts them like HF so bf16/fp16 q and k keep their dtype.
        return self.ops.rope(q, k, positions, self.cos, self.sin)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, ops: TorchOps, tp=None, window: int = 0):
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.window = window   # > 0: a sliding-window layer (attends to its last `window` tokens)
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops)
        self.attn = backend

    def forward(self, x, positions, rope: RotaryEmbedding, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, lora: LayerLoRA | None = None) -> torch.Tensor:
        cfg = self.cfg
        qkv = self.qkv_proj.forward(x)
        if lora is not None:
            lora.add("qkv_proj", qkv, x)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(-1, cfg.num_attention_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_key_value_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_key_value_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        q, k = rope.forward(positions, q, k)
        attended = self.attn(q, k, v, kv_cache[0], kv_cache[1], meta, self.window)
        out = self.o_proj.forward(attended)
        if lora is not None:
            lora.add("o_proj", out, attended)
        if self.tp is not None:   # tensor parallel: each rank has a share of the heads
            self.tp.all_reduce(out)
        return out


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: TorchOps, tp=None, width: int | None = None):
        super().__init__()
        self.ops = ops
        self.tp = tp
        width = width or cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * width, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act_mul = ops.silu_mul if cfg.hidden_act == "silu" else ops.gelu_tanh_mul

    def forward(self, x: torch.Tensor, lora: LayerLoRA | None = None) -> torch.Tensor:
        if lora is not None:
            return self._forward_lora(x, lora)
        out = self.down_proj.forward(self.act_mul(self.gate_up_proj.forward(x)))
        if self.tp is not None:   # tensor parallel: each rank has a share of the columns
            self.tp.all_reduce(out)
        return out

    def _forward_lora(self, x: torch.Tensor, lora: LayerLoRA) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        lora.add("gate_up_proj", gate_up, x)
        h = self.act_mul(gate_up)
        out = self.down_proj.forward(h)
        lora.add("down_proj", out, h)
        return out   # (no tensor parallelism with LoRA: the engine refuses it)


class SparseMoE(nn.Module):
    """A routed MLP (Qwen3-MoE, Mixtral): a softmax router picks `num_experts_per_tok` experts per
    token; each expert is an MLP of `moe_intermediate_size`. The tokens of the whole step (prefill
    chunks and decodes alike) are grouped by expert, and each expert the step touches runs once
    over its tokens, so an expert shared by several tokens is read once; at one token only its k
    experts are read. A token's expert outputs are summed in ascending expert order whatever it is
    batched with (as transformers does), so its numbers do not depend on the step's other tokens
    beyond what its matmuls do. Where every expert's matmuls take the step's groups on a C++ kernel
    (use_kernels), the whole MLP is one call (csrc/moe_cpu.cpp) with the same bits."""

    def __init__(self, cfg: ModelConfig, ops: TorchOps):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)   # the router
        self.experts = nn.ModuleList(MLP(cfg, ops, None, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        self.gelu = cfg.hidden_act != "silu"
        self.last_experts = 0   # distinct experts the last forward ran
        # The one-call path: the kernels, each expert's two weights, and up to how many tokens
        # per expert every expert's matmuls run on the kernel linear_raw calls (0: never).
        self.kernels = None
        self.kernel_tokens = 0
        self._gate_up: list[torch.Tensor] = []
        self._down: list[torch.Tensor] = []
        self._one: torch.Tensor | None = None   # a lone token's pairs: row 0, k times

    def use_kernels(self, kernels) -> bool:
        """Run steps whose experts each take at most `kernel_tokens` tokens through
        ``kernels.moe_experts``: where each expert's gate/up and down run such a group on the
        quantized kernel (QuantLinear: up to its fused width) or the C++ GEMV (CpuLinear: up to
        its gemv_max), as the fused decode loop decides for dense layers -- the same kernels,
        activation and rounding as the loop in forward(), so the same bits."""
        def path(m) -> tuple[torch.Tensor | None, int]:
            if isinstance(m, QuantLinear) and m.bias is None:
                return m.qweight, m.fused_width()
            if isinstance(m, CpuLinear) and m.bias is None and m.weight is not None:
                return m.weight, m.gemv_max
            return None, 0

        paths = [(path(e.gate_up_proj), path(e.down_proj)) for e in self.experts]
        width = min((n for pair in paths for _, n in pair), default=0)
        if kernels is None or not hasattr(kernels, "moe_experts") or width < 1:
            return False
        self.kernels, self.kernel_tokens = kernels, width
        self._one = torch.zeros(self.top_k, dtype=torch.int64)
        self._gate_up = [gu for (gu, _), _ in paths]
        self._down = [dn for _, (dn, _) in paths]
        return True

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights [tokens, k] (x's dtype) and expert ids [tokens, k] of each token."""
        probs = torch.softmax(self.gate.forward(x), dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor, lora: LayerLoRA | None = None) -> torch.Tensor:
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        weights, ids = self.route(x)   # (LoRA on MoE models is refused at engine start)
        if x.shape[0] == 1:   # one token: its k experts, in ascending order
            ids, order = ids[0].sort()
            w = weights[0, order]
            self.last_experts = self.top_k
            chosen = ids.tolist()
            if self.kernels is not None:
                return self.kernels.moe_experts(x, self._one, [1] * self.top_k, [self._gate_up[e] for e in chosen],
                                                [self._down[e] for e in chosen], w, self.gelu)
            out = torch.zeros_like(x)
            for j, e in enumerate(chosen):
                out.add_(self.experts[e].forward(x) * w[j])
            return out
        flat = ids.flatten()
        order = flat.argsort(stable=True)    # (token, slot) pairs grouped by expert, tokens ascending
        tokens = order // self.top_k
        w = weights.flatten()[order]
        counts = torch.bincount(flat, minlength=self.num_experts)
        used = counts.nonzero().flatten().tolist()
        sizes = counts[used].tolist()
        self.last_experts = len(used)
        if self.kernels is not None and max(sizes) <= self.kernel_tokens:
            return self.kernels.moe_experts(x, tokens, sizes, [self._gate_up[e] for e in used],
                                            [self._down[e] for e in used], w, self.gelu)
        out = torch.zeros_like(x)
        w = w.unsqueeze(1)
        start = 0
        for e, n in zip(used, sizes):
            rows = tokens[start:start + n]
            out.index_add_(0, rows, self.experts[e].forward(x[rows]) * w[start:start + n])
            start += n
        return out


# The hot path calls submodules' forward() directly: nn.Module.__call__'s hook checks cost
# ~1.5 us each, ~250 times per step.


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, ops: TorchOps, tp=None, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = Attention(cfg, backend, ops, tp, cfg.layer_window(index))
        # Llama: the norm before the MLP. Gemma 3 (sandwich norms): the norm of the attention's output,
        # with pre_/post_feedforward_layernorm around the MLP.
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        if cfg.layer_is_moe(index):
            if tp is not None:
                raise ValueError("tensor parallelism does not split mixture-of-experts layers yet")
            self.mlp: MLP | SparseMoE = SparseMoE(cfg, ops)
        else:
            self.mlp = MLP(cfg, ops, tp)

    def forward(self, x, residual, positions, rope, kv_cache, meta, lora: LayerLoRA | None = None):
        """Pre-norm block with the residual stream carried separately, so each residual add is
        fused into the next norm: returns (block output, residual before adding it). `lora`: the
        deltas of this step's adapters in this layer, for their rows."""
        h = self.input_layernorm.forward(x) if residual is None else self.input_layernorm.add_forward(x, residual)
        residual = x if residual is None else residual
        h = self.self_attn.forward(h, positions, rope, kv_cache, meta, lora)
        if self.sandwich:
            h = self.pre_feedforward_layernorm.add_forward(self.post_attention_layernorm.forward(h), residual)
            return self.post_feedforward_layernorm.forward(self.mlp.forward(h, lora)), residual
        h = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp.forward(h, lora), residual


class LlamaForCausalLM(nn.Module):
    """With ``tp`` (conveyor.parallel.tp.TPGroup), `cfg` is this rank's slice (its heads and MLP
    width) and the LM head holds ``lm_head_rows`` vocab rows; rank 0's forward returns the full logits."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None = None, ops: TorchOps | None = None,
                 tp=None, lm_head_rows: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        ops = ops or TorchOps()
        self.ops = ops
        backend = backend or TorchPagedAttention(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                                cfg.attention_scale)
        self.attn_backend = backend
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rope = RotaryEmbedding(cfg, ops)
        # Sliding-window layers with their own RoPE base (Gemma 3) share a second table.
        self.rope_local = RotaryEmbedding(cfg, ops, local=True) if cfg.rope_local_theta else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, ops, tp, i) for i in range(cfg.num_hidden_layers))
        self._ropes = [self.rope_local if self.rope_local is not None and cfg.layer_window(i) else self.rope
                       for i in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, lm_head_rows or cfg.vocab_size, bias=False)
        self.cpu_lm_head: CpuLinear | QuantLinear | None = None
        self.fused_decode_tokens = 0   # decode steps of up to this many tokens run all layers in one C++ call
        self._fused_weights: list[list[torch.Tensor]] = []
        self._fused_windows: list[int] = []
        self.requires_grad_(False)

    def lm_head_weight(self) -> torch.Tensor | None:
        """The dense LM head weight (None when it is quantized)."""
        head = self.embed_tokens if self.cfg.tie_word_embeddings else getattr(self, "lm_head", None)
        return getattr(head, "weight", None)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' (and KV cache's) dtype."""
        return self.norm.weight.dtype

    def use_quantized(self, weights: dict[str, QuantTensor], int8: bool = False, dense_copy: bool = False,
                      packed: PackedWeights | None = None) -> None:
        """Compute the matmuls whose weights are given (HF names, GGUF blocks) from them as stored:
        QuantLinear / QuantEmbedding in place of the dense modules, before the dense weights load.
        Fused matmuls (q/k/v, gate/up) take their pieces' rows in order. With `int8`, in the
        int8-activation kernel's layout (rows in 16s; K-quants always); with `dense_copy`, each also holds a dense
        copy for the large steps where that is measured faster (quant.dense_tokens). With `packed`
        (model/packed.py): a module whose tensors it holds takes them (mapped from its file: the
        pieces were not read); on a miss, each module's final tensor is recorded there."""
        given, weights = weights, {k.removeprefix("model."): v for k, v in weights.items()}
        given.clear()   # each block tensor is dropped below once it is concatenated or reordered
        # K-quants have only the int8 kernel: in its layout whatever the other types use.
        layout = (lambda w: w.for_int8() if int8 or w.is_k else w)  # noqa: E731
        hit = packed is not None and packed.hit
        cached = packed.parts if hit else (lambda key: None)  # noqa: E731
        record = packed.record if packed is not None and not hit else (lambda *a: None)  # noqa: E731
        dtype = self.dtype
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            for owner, prefix, attr in self._matmuls(layer):
                key = f"{p}{prefix}.{attr}"
                names = [f"{p}{prefix}.{n}.weight" for n in FUSED.get(attr, (attr,))]
                tensors = cached(key)
                if tensors is None and all(isinstance(weights.get(n), QuantTensor) for n in names):
                    pieces = [weights.pop(n) for n in names]
                    runs: list[list[QuantTensor]] = []   # consecutive pieces of one type fuse
                    for w in pieces:
                        if runs and runs[-1][0].qtype == w.qtype:
                            runs[-1].append(w)
                        else:
                            runs.append([w])
                    del pieces
                    tensors = [layout(QuantTensor.cat(runs.pop(0))) for _ in range(len(runs))]
                if tensors is None:
                    continue
                bias = getattr(owner, attr).bias
                parts = [self._quant_linear(w, None if len(tensors) > 1 else bias, dtype, dense_copy) for w in tensors]
                for j, (w, part) in enumerate(zip(tensors, parts)):
                    record(key if len(parts) == 1 else f"{key}.{j}", w, part, names)
                setattr(owner, attr, parts[0] if len(parts) == 1 else QuantConcat(parts, bias))
                del tensors, parts
        embed = weights.pop("embed_tokens.weight", None)
        embed = (cached("embed_tokens") or [embed])[0]
        if isinstance(embed, QuantTensor):
            embed = layout(embed)   # one copy for the lookup and a tied head
            self.embed_tokens = QuantEmbedding(embed, dtype)
            record("embed_tokens", embed, self.embed_tokens, ["embed_tokens.weight"])
        tied = self.cfg.tie_word_embeddings
        head = embed if tied else (cached("lm_head") or [weights.pop("lm_head.weight", None)])[0]
        if isinstance(head, QuantTensor):
            head = layout(head)
            self.cpu_lm_head = self._quant_linear(head, None, dtype, dense_copy)   # shares a tied embedding's blocks
            record("embed_tokens" if tied else "lm_head", head, self.cpu_lm_head,
                   ["embed_tokens.weight" if tied else "lm_head.weight"])
            if not tied:
                del self.lm_head

    @staticmethod
    def _matmuls(layer: DecoderLayer) -> list[tuple[nn.Module, str, str]]:
        """(owner, HF prefix, attribute) of each matmul a layer may hold quantized: attention's,
        then its MLP's or each expert's (not the router: its weights stay dense)."""
        mlps = [(layer.mlp, "mlp")] if isinstance(layer.mlp, MLP) else \
            [(e, f"mlp.experts.{j}") for j, e in enumerate(layer.mlp.experts)]
        return [(layer.self_attn, "self_attn", "qkv_proj"), (layer.self_attn, "self_attn", "o_proj"),
                *((m, prefix, attr) for m, prefix in mlps for attr in ("gate_up_proj", "down_proj"))]

    @staticmethod
    def _quant_linear(w: QuantTensor, bias, dtype: torch.dtype, dense_copy: bool) -> QuantLinear:
        # Int8 activations serve every step size: a token's numbers then never depend on what it is
        # batched with (a dense path would multiply fp32 activations: 1e-4 apart after 30 layers).
        dense_from = 0 if w.x16 else dense_tokens(dtype, w.qtype, w.in_features, w.out_features, dense_copy)
        dense = dense_module(w, dtype) if dense_copy and dense_from else None
        return QuantLinear(w, bias, dense_from, dense)

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of weights held, by storage: GGUF type names for quantized blocks, else the dtype."""
        out: dict[str, int] = {}
        seen: set[int] = set()

        def add(kind: str, t: torch.Tensor) -> None:
            out[kind] = out.get(kind, 0) + t.numel() * t.element_size()

        for m in self.modules():
            for name, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
                if t is None or t.device.type == "meta" or t.data_ptr() in seen or name in ("cos", "sin"):
                    continue
                seen.add(t.data_ptr())
                add(m.qtype if name == "qweight" else str(t.dtype).removeprefix("torch."), t)
            if isinstance(m, CpuLinear):   # its tensors are plain attributes: the GEMV's weight, the packed one
                if m.weight is not None and m.weight.data_ptr() not in seen:
                    seen.add(m.weight.data_ptr())
                    add(str(m.weight.dtype).removeprefix("torch."), m.weight)
                if m.packed is not None:   # oneDNN's opaque layout: no data pointer to share
                    add("prepacked", m.packed)
        return out

    def weight_bytes_summary(self) -> str:
        b = self.weight_bytes()
        return f"{sum(b.values()) / 2**20:.1f} MiB (" + ", ".join(
            f"{k} {v / 2**20:.1f}" for k, v in sorted(b.items(), key=lambda kv: -kv[1])) + ")"

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], logits_indices: torch.Tensor,
                hidden_indices: torch.Tensor | None = None, lora: LoRABatch | None = None):
        """Logits ``[len(logits_indices), vocab]`` for the selected flattened-token indices only;
        with `hidden_indices`, also the final (normed) hidden states of those rows: (logits, hidden).
        `lora`: the step's LoRA adapters and their rows (model/lora.py); None: the base model only."""
        x = self.embed_tokens(input_ids)
        if self.cfg.embedding_multiplier is not None:   # Gemma: the scale rounded to the activations' dtype
            x = x * torch.tensor(self.cfg.embedding_multiplier, dtype=x.dtype)
        # (the fused C++ layer loop has no LoRA: a step with LoRA rows takes the Python one)
        if input_ids.shape[0] <= self.fused_decode_tokens and not meta.prefills and len(meta.decodes) == 1 \
                and lora is None:
            x, residual = self._fused_decode(x, positions, kv_caches, meta)
        else:
            residual = None
            metas = meta.layers or [meta] * len(self.layers)   # (layer groups: each its block tables)
            loras = repeat(None) if lora is None else lora.layers(len(self.layers))
            for layer, rope, kv, m, layer_lora in zip(self.layers, self._ropes, kv_caches, metas, loras):
                x, residual = layer.forward(x, residual, positions, rope, kv, m, layer_lora)
        rows = logits_indices if hidden_indices is None else torch.cat([logits_indices, hidden_indices])
        x = x[rows] if residual is None else x[rows] + residual[rows]
        x = self.norm.forward(x)
        n = logits_indices.numel()
        if n == 0:   # a step of embedding requests only: no logits (and no collective, on any rank)
            logits = x.new_empty((0, self.cfg.vocab_size))
        else:
            head = x[:n] if hidden_indices is not None else x
            if self.cpu_lm_head is not None:
                logits = self.cpu_lm_head.forward(head)
            else:
                logits = F.linear(head, self.lm_head_weight())
            if self.tp is not None:
                logits = self.tp.gather_logits(logits)
        return logits if hidden_indices is None else (logits, x[n:])

    def cpu_linears(self, packed, gemv_max: int) -> None:
        """Every matmul (the LM head too) through CpuLinear: the C++ GEMV up to `gemv_max` tokens,
        oneDNN's prepacked layout (when `packed`: a bool, or a function of (in_features,
        out_features) choosing per shape) above (CPU; see linear.py)."""
        choose = packed if callable(packed) else (lambda k, n: packed)
        for layer in self.layers:
            replace_linears(layer, choose, gemv_max)
        head = self.lm_head_weight()
        if head is not None:
            self.cpu_lm_head = CpuLinear(head, None, choose(head.shape[1], head.shape[0]), gemv_max)
            if not self.cfg.tie_word_embeddings:
                del self.lm_head   # the CpuLinear holds what is needed of it
        # The fused loop runs a step when every layer matmul takes it on a kernel it calls: the
        # GEMV (dense, up to gemv_max tokens) or the quantized kernel (up to its pass width, and
        # below the token count where the layer would go dense).
        copies = {id(m.dense) for m in self.layers.modules() if isinstance(m, QuantLinear)}
        widths = [m.fused_width() if isinstance(m, QuantLinear) else gemv_max for layer in self.layers
                  for m in layer.modules() if isinstance(m, (CpuLinear, QuantLinear)) and id(m) not in copies]
        width = min(widths, default=0)
        # The fused loop takes q/k/v in up to three pieces (QuantConcat), gate/up in one.
        # (Routed MLPs are not in the fused loop: a MoE model's steps run the Python layer loop, its
        # routed MLP in one C++ call per layer where the experts' kernels take the step.)
        if isinstance(self.ops, CpuFusedOps):
            kernels = load_cpu_kernels()
            for layer in self.layers:
                if isinstance(layer.mlp, SparseMoE):
                    layer.mlp.use_kernels(kernels)
        fusable = not self.cfg.is_moe and not any(isinstance(layer.mlp.gate_up_proj, QuantConcat)
                                                  for layer in self.layers)
        if width and fusable and self.tp is None and isinstance(self.attn_backend, CpuPagedAttention) \
                and isinstance(self.ops, CpuFusedOps):
            self.fused_decode_tokens = width
            self._fused_weights = [self._layer_tensors(layer) for layer in self.layers]
            self._fused_windows = [layer.self_attn.window for layer in self.layers]

    def dispatch_thresholds(self) -> dict[str, int]:
        """The token counts where this model's kernel path changes (a step of up to N tokens takes
        one path, N + 1 the next): the C++ GEMV's width, the fused decode loop's and where the int8
        kernel's 32-blocks move to AMX tiles. Zero-width
        paths are left out. A step-cost profile needs a knot on both sides of each (a straight
        line across a switch mispredicts the steps near it). ``prefill_rowwise`` (1, not a token
        count) marks prompts' attention on the decode kernel (batch invariance; per layer 1-1.6x SDPA's
        time in fp32, 2.6-3.8x in bf16), so that a profile measured with the other records a different set."""
        gemv = max((m.gemv_max for m in self.modules() if isinstance(m, CpuLinear)), default=0)
        dense = sorted({m.dense_from - 1 for m in self.modules() if isinstance(m, QuantLinear) and m.dense_from})
        blocks32 = any(isinstance(m, QuantLinear) and m.x16 and m.qtype in NATIVE_BLOCK_BYTES for m in self.modules())
        out = {"gemv_tokens": gemv, "fused_decode_tokens": self.fused_decode_tokens,
               **{f"quant_dense_tokens_{i}": t for i, t in enumerate(dense)},
               "int8_amx_tokens": int8_amx_tokens() - 1 if blocks32 else 0,
               "prefill_rowwise": int(bool(getattr(self.attn_backend, "rowwise_prefill", False)))}
        return {k: v for k, v in out.items() if v > 0}

    @staticmethod
    def _layer_tensors(layer: DecoderLayer) -> list[torch.Tensor]:
        """A layer's tensors in the order of csrc/decode_layers_cpu.cpp; empty where absent."""
        none = torch.empty(0)
        attn, mlp = layer.self_attn, layer.mlp
        qk = (attn.q_norm.weight, attn.k_norm.weight) if attn.cfg.qk_norm else (none, none)
        w = lambda m: m.qweight if isinstance(m, QuantLinear) else m.weight  # noqa: E731
        pieces = [w(p) for p in attn.qkv_proj.parts] if isinstance(attn.qkv_proj, QuantConcat) else [w(attn.qkv_proj)]
        pieces += [none] * (3 - len(pieces))
        if layer.sandwich:   # Gemma: the norm before the MLP, and those of the attention's and MLP's outputs
            pre_mlp, outs = layer.pre_feedforward_layernorm, (layer.post_attention_layernorm.weight,
                                                              layer.post_feedforward_layernorm.weight)
        else:
            pre_mlp, outs = layer.post_attention_layernorm, (none, none)
        return [t if t is not None else none for t in (
            layer.input_layernorm.weight, pieces[0], attn.qkv_proj.bias, w(attn.o_proj),
            pre_mlp.weight, w(mlp.gate_up_proj), mlp.gate_up_proj.bias,
            w(mlp.down_proj), mlp.down_proj.bias, *qk, pieces[1], pieces[2], *outs)]

    def _fused_decode(self, x, positions, kv_caches, meta: AttentionMetadata):
        """The layer loop of a decode step in one C++ call (same kernels, same order, same numbers)."""
        cfg, group = self.cfg, meta.decodes[0]
        metas = meta.layers or [meta]   # (layer groups: each its slots and block tables)
        # The RoPE tables of the one or two distinct rotary modules, read once (a module attribute
        # per layer cost ~40 us a step); read each step, since a module may rebuild them.
        tables = {id(r): (r.cos, r.sin) for r in (self.rope, self.rope_local) if r is not None}
        cos, sin = zip(*(tables[id(r)] for r in self._ropes))
        return self.attn_backend.kernels.decode_layers(
            x, self._fused_weights, [kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches], positions,
            list(cos), list(sin), self._fused_windows, [m.slot_mapping for m in metas],
            [m.decodes[0].block_tables for m in metas], group.context_lens, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps,
            self.attn_backend.scale, cfg.hidden_act != "silu")

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Load weights named as in HF checkpoints, fusing q/k/v and gate/up on the way."""
        own = self.state_dict()
        fused: dict[str, list[torch.Tensor | None]] = {}
        loaded: set[str] = set()
        for name, tensor in weights.items():
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in FUSED_PIECE:
                target, idx = FUSED_PIECE[parts[-2]]
                key = ".".join(parts[:-2] + [target, parts[-1]])
                fused.setdefault(key, [None] * len(FUSED[target]))[idx] = tensor
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            if self.cfg.norm_unit_offset and name.endswith("norm.weight"):
                tensor = 1.0 + tensor.float()   # HF Gemma scales by (1 + w), computed in fp32
            self._copy(own, name, tensor, loaded)
        for key, pieces in fused.items():
            if any(p is None for p in pieces):
                raise ValueError(f"incomplete fused weight {key}: a q/k/v or gate/up piece is missing")
            self._copy(own, key, torch.cat(pieces, dim=0), loaded)
        missing = set(own) - loaded
        if missing:
            raise ValueError(f"weights missing from checkpoint: {sorted(missing)[:8]}")

    @staticmethod
    def _copy(own: dict[str, torch.Tensor], name: str, tensor: torch.Tensor, loaded: set[str]) -> None:
        if name not in own:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        if own[name].shape != tensor.shape:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(own[name].shape)}")
        own[name].copy_(tensor)
        loaded.add(name)
