"""A roofline cost model for named GPUs: a model built from datasheet numbers, not a measurement.

A step's time is the larger of its matmul + attention FLOPs at the GPU's dense bf16 peak and
its bytes (weights once, the KV the step reads and writes) at its memory bandwidth; a
mixture-of-experts model's step reads only the experts its tokens route to (expected distinct
experts of T tokens each picking k of E: E (1 - (1 - k/E)^T)) and computes k per token, each scaled
by an efficiency factor, plus a fixed per-step overhead, plus — with tensor parallelism — two
ring all-reduces of the step's activations per layer over NVLink. Swaps cross PCIe.
Assumptions and what they leave out are written in docs/simulator.md. No torch here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from conveyor.scheduler.costs import StepShape
from conveyor.scheduler.output import SchedulerOutput


@dataclass(frozen=True, slots=True)
class GPU:
    name: str
    bf16_flops: float      # dense bf16 tensor-core peak, FLOP/s
    hbm_bw: float          # memory bandwidth, bytes/s
    memory: float          # bytes
    pcie_bw: float         # host link, bytes/s per direction
    nvlink_bw: float       # GPU-GPU link, bytes/s per direction (0: none, PCIe is used)


# Vendor datasheet figures (SXM parts; dense bf16, i.e. without 2:4 sparsity).
GPUS = {
    "h100": GPU("H100 SXM 80GB", 989e12, 3.35e12, 80e9, 64e9, 450e9),
    "h200": GPU("H200 SXM 141GB", 989e12, 4.8e12, 141e9, 64e9, 450e9),
    "a100": GPU("A100 SXM 80GB", 312e12, 2.039e12, 80e9, 32e9, 300e9),
    "l4": GPU("L4 24GB", 121e12, 300e9, 24e9, 32e9, 0.0),
}


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    experts: int = 0              # > 0: routed MLPs (every layer), `experts_per_token` of them per token
    experts_per_token: int = 0
    expert_intermediate: int = 0

    @classmethod
    def from_hf_config(cls, config: dict, name: str = "model") -> ModelShape:
        heads = config["num_attention_heads"]
        experts = config.get("num_experts") or config.get("num_local_experts") or 0
        moe = {}
        if experts:
            moe = {"experts": experts, "experts_per_token": config.get("num_experts_per_tok", 2),
                   "expert_intermediate": config.get("moe_intermediate_size") or config["intermediate_size"]}
        return cls(name, config["hidden_size"], config["num_hidden_layers"], heads,
                   config.get("num_key_value_heads") or heads,
                   config.get("head_dim") or config["hidden_size"] // heads,
                   config["intermediate_size"], config["vocab_size"], **moe)

    @property
    def attention_params(self) -> int:
        """q, k, v and o of one layer."""
        q = self.heads * self.head_dim
        return self.hidden * (q + 2 * self.kv_heads * self.head_dim) + q * self.hidden

    @property
    def layer_params(self) -> int:
        """Matmul weights of one decoder layer (q, k, v, o, gate, up, down; a MoE layer: every
        expert's and the router)."""
        if self.experts:
            return self.attention_params + self.experts * (3 * self.hidden * self.expert_intermediate + self.hidden)
        return self.attention_params + 3 * self.hidden * self.intermediate

    @property
    def matmul_params(self) -> int:
        return self.layers * self.layer_params

    @property
    def active_params(self) -> int:
        """Matmul weights one token multiplies (a MoE layer: its k experts and the router)."""
        if not self.experts:
            return self.matmul_params
        per = self.attention_params + self.experts_per_token * 3 * self.hidden * self.expert_intermediate \
            + self.experts * self.hidden
        return self.layers * per

    def read_params(self, tokens: int) -> float:
        """Matmul weights a step of `tokens` tokens reads: all of them for a dense model; for a MoE
        model the experts its tokens route to, E (1 - (1 - k/E)^T) expected per layer with uniform
        routing (an upper bound: real routers favour some experts, so batches share more)."""
        if not self.experts:
            return self.matmul_params
        touched = self.experts * (1 - (1 - self.experts_per_token / self.experts) ** max(tokens, 1))
        expert = 3 * self.hidden * self.expert_intermediate
        return self.layers * (self.attention_params + self.experts * self.hidden + touched * expert)

    @property
    def params(self) -> int:
        """All weights (embedding and LM head counted once each, as if untied)."""
        return self.matmul_params + 2 * self.vocab * self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int = 2, tp: int = 1) -> int:
        kv_heads = math.ceil(self.kv_heads / tp)   # fewer KV heads than ranks: replicated
        return self.layers * 2 * kv_heads * self.head_dim * dtype_bytes


# Shapes of public checkpoints (their config.json), for planning without the weights at hand.
MODEL_PRESETS = {
    "smollm2-135m": ModelShape("SmolLM2-135M", 576, 30, 9, 3, 64, 1536, 49152),
    "llama-3.1-8b": ModelShape("Llama-3.1-8B", 4096, 32, 32, 8, 128, 14336, 128256),
    "llama-3.1-70b": ModelShape("Llama-3.1-70B", 8192, 80, 64, 8, 128, 28672, 128256),
    "qwen2.5-7b": ModelShape("Qwen2.5-7B", 3584, 28, 28, 4, 128, 18944, 152064),
    "mistral-7b": ModelShape("Mistral-7B", 4096, 32, 32, 8, 128, 14336, 32000),
    "qwen3-30b-a3b": ModelShape("Qwen3-30B-A3B", 2048, 48, 32, 4, 128, 6144, 151936, 128, 8, 768),
    "mixtral-8x7b": ModelShape("Mixtral-8x7B", 4096, 32, 32, 8, 128, 14336, 32000, 8, 2, 14336),
}


def model_shape(spec: str) -> ModelShape:
    """A preset name, an HF config.json, or a directory holding one."""
    if spec.lower() in MODEL_PRESETS:
        return MODEL_PRESETS[spec.lower()]
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"unknown model {spec!r}: a preset ({', '.join(MODEL_PRESETS)}) or an HF config.json")
    return ModelShape.from_hf_config(json.loads(path.read_text()), path.parent.name)


@dataclass(slots=True)
class RooflineCostModel:
    gpu: GPU
    model: ModelShape
    tp: int = 1
    dtype_bytes: int = 2
    compute_efficiency: float = 0.5     # achieved / peak FLOP/s on the step's matmuls
    bandwidth_efficiency: float = 0.8   # achieved / peak memory bandwidth
    step_overhead: float = 0.5e-3       # seconds per step outside the GPU's work (scheduling, launches)
    allreduce_latency: float = 8e-6     # seconds per all-reduce, on top of its bytes
    pcie_efficiency: float = 0.8
    block_size: int = 16                # tokens per KV block (swap copies move whole blocks)

    def flops(self, s: StepShape) -> float:
        m = self.model
        tokens = s.prefill_tokens + s.decode_tokens
        attention = 4 * m.layers * m.heads * m.head_dim * (s.prefill_attention + s.decode_context)
        return 2 * m.active_params * tokens + attention + 2 * m.hidden * m.vocab * s.num_sampled

    def bytes(self, s: StepShape) -> float:
        """Bytes one GPU moves: its share of the weights once; the cached KV the step reads (each
        context once) and the KV of every token it computes, written once."""
        m = self.model
        weights = m.read_params(s.prefill_tokens + s.decode_tokens) + (m.vocab * m.hidden if s.num_sampled else 0)
        kv_tokens = s.decode_context + s.prefill_context + s.prefill_tokens + s.decode_tokens
        return weights * self.dtype_bytes / self.tp + self.model.kv_bytes_per_token(self.dtype_bytes, self.tp) * kv_tokens

    def allreduce_time(self, s: StepShape) -> float:
        if self.tp == 1:
            return 0.0
        link = self.gpu.nvlink_bw or self.gpu.pcie_bw
        size = (s.prefill_tokens + s.decode_tokens) * self.model.hidden * self.dtype_bytes
        one = 2 * (self.tp - 1) / self.tp * size / link + self.allreduce_latency
        return 2 * self.model.layers * one

    def shape_time(self, s: StepShape) -> float:
        compute = self.flops(s) / (self.gpu.bf16_flops * self.compute_efficiency * self.tp)
        memory = self.bytes(s) / (self.gpu.hbm_bw * self.bandwidth_efficiency)
        return max(compute, memory) + self.step_overhead + self.allreduce_time(s)

    def step_time(self, plan: SchedulerOutput) -> float:
        return self.shape_time(StepShape.of(plan))

    def swap_time(self, num_blocks: int) -> float:
        block = self.block_size * self.model.kv_bytes_per_token(self.dtype_bytes, self.tp)
        return num_blocks * block / (self.gpu.pcie_bw * self.pcie_efficiency)

    def recompute_time_per_token(self, context: int = 256) -> float:
        s = StepShape(prefill_tokens=context, prefill_attention=context * (context + 1) / 2, num_seqs=1)
        return (self.shape_time(s) - self.step_overhead) / context

    def num_kv_blocks(self, memory_utilization: float = 0.9) -> int:
        """KV blocks that fit on one GPU beside its share of the weights (activations: 5% of memory)."""
        free = self.gpu.memory * (memory_utilization - 0.05) - self.model.params * self.dtype_bytes / self.tp
        per_block = self.block_size * self.model.kv_bytes_per_token(self.dtype_bytes, self.tp)
        if free < per_block:
            raise ValueError(f"{self.model.name} does not fit on {self.tp} x {self.gpu.name} "
                             f"({self.model.params * self.dtype_bytes / 1e9:.0f} GB of weights)")
        return int(free // per_block)
