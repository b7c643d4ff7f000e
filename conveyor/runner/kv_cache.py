"""The KV cache tensors (device) and the host swap pool, addressed by block ids."""

from __future__ import annotations

import torch

from conveyor.model.config import ModelConfig
from conveyor.runner.hugepages import empty_huge


class KVCacheTensors:
    """One tensor ``[layers, 2, kv_heads, blocks, block_size, head_dim]``; a layer's K and V are views."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, pin_memory: bool = False):
        shape = (cfg.num_hidden_layers, 2, cfg.num_key_value_heads, num_blocks, block_size, cfg.head_dim)
        if torch.device(device).type == "cpu" and not pin_memory:
            self.data = empty_huge(shape, dtype)   # 2 MiB pages: a block read is rarely a TLB miss
        else:
            self.data = torch.zeros(shape, device=device, dtype=dtype, pin_memory=pin_memory)
        self.num_blocks = num_blocks
        self.block_size = block_size

    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer[0], layer[1]) for layer in self.data]

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype_bytes: int = 4) -> int:
        return cfg.kv_bytes_per_token(dtype_bytes) * block_size

    def copy_blocks_to(self, other: KVCacheTensors, mapping: list[tuple[int, int]]) -> None:
        """Copy blocks ``src`` of self into blocks ``dst`` of other (swap-out or swap-in)."""
        if not mapping:
            return
        src = torch.tensor([s for s, _ in mapping], device=self.data.device)
        dst = torch.tensor([d for _, d in mapping], device=other.data.device)
        blocks = self.data.index_select(3, src).to(other.data.device, non_blocking=True)
        other.data.index_copy_(3, dst, blocks)
