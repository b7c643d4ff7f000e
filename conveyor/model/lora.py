"""LoRA deltas on the model's fused matmuls, for the rows of each adapter of a step (grouped, "SGMV-style").

An adapter's per-projection A/B (conveyor/lora/adapter.py) are laid out once for the model's
fused matmuls: q/k/v go to ``qkv_proj``'s column ranges, gate/up to ``gate_up_proj``'s; the A of
the pieces a matmul fuses are stacked, so that each adapter costs one gather and one x A^T per
matmul. Per step the runner gives the rows of each adapter (``LoRABatch``); after the base
matmul (whatever its path: the GEMV, oneDNN, the quantized kernels) each group adds its delta
to its rows, y[rows, cols] += (x[rows] A^T) B^T. Rows of the base model are never touched, and
a step without LoRA rows passes no batch at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from conveyor.lora.adapter import BaseShapes, LoRAAdapter
from conveyor.lora.peft_config import MODULES
from conveyor.model.config import ModelConfig

Rows = slice | torch.Tensor   # a contiguous run of flattened rows, or their indices (ascending)


def base_shapes(cfg: ModelConfig) -> BaseShapes:
    """Each projection's (in_features, out_features), for checking an adapter against the model."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return BaseShapes(cfg.num_hidden_layers, {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)})


def _columns(cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """Projection -> (the model's matmul holding it, its first output column, its end)."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, q + kv), "v_proj": ("qkv_proj", q + kv, q + 2 * kv),
            "o_proj": ("o_proj", 0, h), "gate_proj": ("gate_up_proj", 0, i), "up_proj": ("gate_up_proj", i, 2 * i),
            "down_proj": ("down_proj", 0, h)}


@dataclass(slots=True)
class Delta:
    """One adapter's delta on one of the model's matmuls."""
    a: torch.Tensor   # [R, in]: the A of each adapted piece, stacked
    # per adapted piece: its rows of x A^T (r0, r1), its output columns (c0, c1), its B [c1 - c0, r1 - r0]
    pieces: list[tuple[int, int, int, int, torch.Tensor]]


AdapterDeltas = list[dict[str, Delta]]   # per decoder layer: the model's matmul name -> its delta


def fuse(adapter: LoRAAdapter, cfg: ModelConfig) -> AdapterDeltas:
    """An adapter laid out for the model's fused matmuls (pieces in column order)."""
    columns = _columns(cfg)
    out = []
    for layer in adapter.layers:
        deltas: dict[str, Delta] = {}
        for proj in MODULES:   # in column order within each fused matmul
            w = layer.get(proj)
            if w is None:
                continue
            module, c0, c1 = columns[proj]
            d = deltas.get(module)
            r0 = 0 if d is None else d.pieces[-1][1]
            piece = (r0, r0 + w.a.shape[0], c0, c1, w.b)
            if d is None:
                deltas[module] = Delta(w.a, [piece])
            else:
                d.a = torch.cat([d.a, w.a])
                d.pieces.append(piece)
        out.append(deltas)
    return out


@dataclass(slots=True)
class LayerLoRA:
    """One decoder layer's share of a step's LoRA batch: (the adapter's deltas in this layer, its rows)."""
    groups: list[tuple[dict[str, Delta], Rows]]

    def add(self, name: str, y: torch.Tensor, x: torch.Tensor) -> None:
        """y += each group's delta of matmul `name` on its rows (in place; y = the base matmul of x)."""
        for deltas, rows in self.groups:
            d = deltas.get(name)
            if d is None:
                continue
            gathered = isinstance(rows, torch.Tensor)
            h = F.linear(x.index_select(0, rows) if gathered else x[rows], d.a)
            one = len(d.pieces) == 1
            for r0, r1, c0, c1, b in d.pieces:
                part = F.linear(h if one else h[:, r0:r1], b)
                if gathered:
                    (y if c1 - c0 == y.shape[1] else y[:, c0:c1]).index_add_(0, rows, part)
                else:
                    y[rows, c0:c1].add_(part)


@dataclass(slots=True)
class LoRABatch:
    """A step's LoRA rows: group g's rows (flattened token indices) run under adapters[g]; the rows
    of no group are the base model's."""
    adapters: list[AdapterDeltas]
    rows: list[Rows]

    def layers(self, num_layers: int) -> list[LayerLoRA | None]:
        """Per decoder layer, its groups (None where no adapter of the step adapts the layer)."""
        out = []
        for i in range(num_layers):
            groups = [(a[i], r) for a, r in zip(self.adapters, self.rows) if a[i]]
            out.append(LayerLoRA(groups) if groups else None)
        return out
