"""The KV cache tensors (device) and the host swap pool, addressed by block ids."""

from __future__ import annotations

import torch

from conveyor.kv.layout import KVLayout
from conveyor.model.config import ModelConfig
from conveyor.runner.hugepages import empty_huge


class KVCacheTensors:
    """One tensor ``[slots, 2, kv_heads, blocks, block_size, head_dim]``; a layer's K and V are views
    of its slot (conveyor/kv/layout.py: one slot per layer unless the layers form groups). With a
    windowed layout, one more block than the pool's: the null block (zeros, never written)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, pin_memory: bool = False, layout: KVLayout | None = None,
                 null_block: bool = False):
        self.layout = layout or KVLayout.single(cfg.num_hidden_layers)
        shape = (self.layout.slots, 2, cfg.num_key_value_heads, num_blocks + null_block, block_size, cfg.head_dim)
        if torch.device(device).type == "cpu" and not pin_memory:
            self.data = empty_huge(shape, dtype)   # 2 MiB pages: a block read is rarely a TLB miss
        else:
            self.data = torch.zeros(shape, device=device, dtype=dtype, pin_memory=pin_memory)
        self.num_blocks = num_blocks
        self.block_size = block_size

    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.data[s][0], self.data[s][1]) for s in self.layout.layer_slot]

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype_bytes: int = 4, layout: KVLayout | None = None) -> int:
        """A block's bytes: every layer's K/V for block_size tokens, or a group's slots' (layout)."""
        per_layer = cfg.kv_bytes_per_token(dtype_bytes) // cfg.num_hidden_layers
        slots = cfg.num_hidden_layers if layout is None else layout.slots
        return per_layer * slots * block_size

    def copy_blocks_to(self, other: KVCacheTensors, mapping: list[tuple[int, int]]) -> None:
        """Copy blocks ``src`` of self into blocks ``dst`` of other (swap-out or swap-in)."""
        if not mapping:
            return
        src = torch.tensor([s for s, _ in mapping], device=self.data.device)
        dst = torch.tensor([d for _, d in mapping], device=other.data.device)
        blocks = self.data.index_select(3, src).to(other.data.device, non_blocking=True)
        other.data.index_copy_(3, dst, blocks)
