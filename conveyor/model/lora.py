"""LoRA deltas on the model's fused matmuls, for the rows of each adapter of a step (grouped, "SGMV-style").

An adapter's per-projection A/B (conveyor/lora/adapter.py) are laid out once for the model's
fused matmuls: q/k/v go to ``qkv_proj``'s column ranges, gate/up to ``gate_up_proj``'s; the A of
the pieces a matmul fuses are stacked, so that each adapter costs one gather and one x A^T per
matmul. Per step the runner gives the rows of each adapter (``LoRABatch``); after the base
matmul (whatever its path: the GEMV, oneDNN, the quantized kernels) each group adds its delta
to its rows, y[rows, cols] += (x[rows] A^T) B^T. Rows of the base model are never touched, and
a step without LoRA rows passes no batch at all.

Two ways to add them. Where the C++ kernels load, ``lora_sgmv_`` (csrc/lora_cpu.cpp): one call per
matmul for all the step's adapters, rows sorted by adapter and taken a few at a time. Else the
grouped torch ops: per adapter, a gather and two matmuls over its rows and an index_add, a few ops
per adapter and matmul (measured with 16 adapters on the demo model, bf16: 8 ms per matmul of a
1,024-token prefill step, against ~0.2 ms in the kernel; 0.19 ms per matmul of a 64-row decode step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from conveyor.model.cpu_kernels import cpu_kernels

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
    bt: torch.Tensor | None = None   # [R, out]: every piece's B transposed in its columns, zero elsewhere (the kernel's)


AdapterDeltas = list[dict[str, Delta]]   # per decoder layer: the model's matmul name -> its delta


def fuse(adapter: LoRAAdapter, cfg: ModelConfig) -> AdapterDeltas:
    """An adapter laid out for the model's fused matmuls (pieces in column order)."""
    columns = _columns(cfg)
    widths: dict[str, int] = {}
    for module, _, c1 in columns.values():
        widths[module] = max(widths.get(module, 0), c1)
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
        for module, d in deltas.items():
            d.a = d.a.contiguous()
            d.bt = d.a.new_zeros((d.a.shape[0], widths[module]))
            for r0, r1, c0, c1, b in d.pieces:
                d.bt[r0:r1, c0:c1] = b.t()
        out.append(deltas)
    return out


_EMPTY = torch.empty(0)


@dataclass(slots=True)
class LayerLoRA:
    """One decoder layer's share of a step's LoRA batch: (the adapter's deltas in this layer, its rows);
    for the kernel, every adapter's deltas in this layer (`by_group`, {} where it adapts none) and the
    step's rows sorted by adapter (LoRABatch.order, .starts)."""
    groups: list[tuple[dict[str, Delta], Rows]]
    by_group: list[dict[str, Delta]] | None = None
    batch: LoRABatch | None = None
    kernels: object = None

    def add(self, name: str, y: torch.Tensor, x: torch.Tensor) -> None:
        """y += each group's delta of matmul `name` on its rows (in place; y = the base matmul of x)."""
        if self.kernels is not None:
            assert y.is_contiguous(), "the kernel adds in place to a contiguous output"
            deltas = [g.get(name) for g in self.by_group]
            if any(d is not None for d in deltas):
                self.kernels.lora_sgmv_(y, x.contiguous(), self.batch.order, self.batch.starts,
                                        [_EMPTY if d is None else d.a for d in deltas],
                                        [_EMPTY if d is None else d.bt for d in deltas])
            return
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
    of no group are the base model's. For the kernel (None: the grouped torch ops): `order`, the rows
    under an adapter sorted by group (int32), and `starts` (int32 [G + 1]): group g's are
    order[starts[g]:starts[g + 1]]."""
    adapters: list[AdapterDeltas]
    rows: list[Rows]
    order: torch.Tensor | None = None
    starts: torch.Tensor | None = None

    def layers(self, num_layers: int) -> list[LayerLoRA | None]:
        """Per decoder layer, its groups (None where no adapter of the step adapts the layer)."""
        if self.order is not None:
            some = next((d for a in self.adapters for layer in a for d in layer.values()), None)
            kernels = cpu_kernels(some.a.device, some.a.dtype) if some is not None else None
            assert kernels is not None or some is None, "a batch for the kernel where it does not load"
            return [LayerLoRA([], by_group, self, kernels) if any(by_group) else None
                    for by_group in ([a[i] for a in self.adapters] for i in range(num_layers))]
        out = []
        for i in range(num_layers):
            groups = [(a[i], r) for a, r in zip(self.adapters, self.rows) if a[i]]
            out.append(LayerLoRA(groups) if groups else None)
        return out
