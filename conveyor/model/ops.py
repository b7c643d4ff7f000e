"""Elementwise ops of the decoder layer: portable torch versions and fused C++ CPU versions.

Both compute the same math; the fused ones make one pass over the activations instead of
several, which matters at decode batch sizes where these ops are launch- and memory-bound.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.model.cpu_kernels import cpu_kernels


class TorchOps:
    @staticmethod
    def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype != torch.float32:   # the statistics in fp32, as HF does for bf16/fp16
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += x (in place), then the norm of the new residual."""
        residual.add_(x)
        return self.rms_norm(residual, w, eps)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU (Gemma): gelu(gate, tanh approximation) * up."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    @staticmethod
    def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = cos[positions].unsqueeze(1).to(q.dtype)   # [T, 1, d/2]
        s = sin[positions].unsqueeze(1).to(q.dtype)
        out = []
        for x in (q, k):
            x1, x2 = x.chunk(2, dim=-1)
            out.append(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))
        return out[0], out[1]


class CpuFusedOps(TorchOps):
    """CPU, fp32 or bf16: the same ops through the C++ extension, math in fp32."""

    def __init__(self, kernels):
        self.k = kernels

    def rms_norm(self, x, w, eps):
        return self.k.rms_norm(x.contiguous(), w, eps)

    def add_rms_norm(self, x, residual, w, eps):
        return self.k.add_rms_norm(x.contiguous(), residual, w, eps)

    def silu_mul(self, gate_up):
        return self.k.silu_mul(gate_up)

    def gelu_tanh_mul(self, gate_up):
        return self.k.gelu_tanh_mul(gate_up.contiguous())

    def rope(self, q, k, positions, cos, sin):
        self.k.rope_(q, positions, cos, sin)
        self.k.rope_(k, positions, cos, sin)
        return q, k


def make_ops(device: torch.device | str, dtype: torch.dtype) -> TorchOps:
    kernels = cpu_kernels(device, dtype)
    return CpuFusedOps(kernels) if kernels is not None else TorchOps()
