"""How a model's weights split over tensor-parallel ranks (Megatron style); no communication here.

Each rank holds whole KV-head groups of attention (q heads with the KV head they read; with fewer
KV heads than ranks a KV head is replicated and its q heads split), a column slice of gate/up and
the matching row slice of down_proj, and a vocab slice of the LM head. It sits in the model
package because the loader builds a rank's slice with it; conveyor/parallel/tp.py (the process
group and its collectives) sits above the model and re-exports these names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from conveyor.model.config import ModelConfig


def split(n: int, world: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's share of n items split as evenly as possible (the first get one more)."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def head_ranges(nq: int, nkv: int, world: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(q heads, kv heads) of a rank, as [start, stop) ranges; every rank's q heads read only its kv heads."""
    group = nq // nkv
    if nkv >= world:   # whole GQA groups, as evenly as possible (9 q / 3 kv heads on 2 ranks: 6+3)
        kv = split(nkv, world, rank)
        return (kv[0] * group, kv[1] * group), kv
    if world % nkv or group % (world // nkv):
        raise ValueError(f"cannot split {nq} attention heads with {nkv} KV heads over {world} ranks "
                         f"(with fewer KV heads than ranks, ranks must divide evenly over KV heads and "
                         f"their q heads)")
    per_kv = world // nkv   # fewer KV heads than ranks: each KV head is replicated on per_kv ranks
    kv, part = divmod(rank, per_kv)
    q0 = kv * group + part * (group // per_kv)
    return (q0, q0 + group // per_kv), (kv, kv + 1)


@dataclass(slots=True, frozen=True)
class Shard:
    """What rank `rank` of `world` holds."""

    rank: int
    world: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab_size: int          # the full vocabulary
    vocab_shard: int         # LM-head rows per rank (the last rank's are zero-padded)

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, world: int) -> Shard:
        if world > cfg.num_attention_heads:
            raise ValueError(f"tensor_parallel_size {world} exceeds the model's {cfg.num_attention_heads} "
                             f"attention heads")
        q, kv = head_ranges(cfg.num_attention_heads, cfg.num_key_value_heads, world, rank)
        return cls(rank, world, q, kv, split(cfg.intermediate_size, world, rank), cfg.vocab_size,
                   -(-cfg.vocab_size // world))

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config of this rank's slice (its heads and MLP width; the LM head is never tied)."""
        return dataclasses.replace(cfg, num_attention_heads=self.q_heads[1] - self.q_heads[0],
                                   num_key_value_heads=self.kv_heads[1] - self.kv_heads[0],
                                   intermediate_size=self.intermediate[1] - self.intermediate[0],
                                   tie_word_embeddings=False)

    def shard_weights(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF-named weights of the full model -> this rank's slices, still HF-named."""
        hd = cfg.head_dim
        q = slice(self.q_heads[0] * hd, self.q_heads[1] * hd)
        kv = slice(self.kv_heads[0] * hd, self.kv_heads[1] * hd)
        inter = slice(*self.intermediate)
        rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": inter, "up_proj": inter}
        cols = {"o_proj": q, "down_proj": inter}
        out: dict[str, torch.Tensor] = {}
        for name, t in weights.items():
            parts = name.split(".")
            module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
            if module in rows:
                out[name] = t[rows[module]]
            elif module in cols and kind == "weight":
                out[name] = t[:, cols[module]]
            elif module in cols:   # a bias added after the all-reduce: once, on rank 0
                out[name] = t if self.rank == 0 else torch.zeros_like(t)
            elif name.removeprefix("model.") == "lm_head.weight":
                continue
            else:
                out[name] = t
        head = weights.get("lm_head.weight")
        if head is None or cfg.tie_word_embeddings:
            head = weights.get("model.embed_tokens.weight", weights.get("embed_tokens.weight"))
        start = self.rank * self.vocab_shard
        piece = head[start:start + self.vocab_shard]
        if piece.shape[0] < self.vocab_shard:
            piece = torch.cat([piece, piece.new_zeros(self.vocab_shard - piece.shape[0], piece.shape[1])])
        out["lm_head.weight"] = piece
        return out
