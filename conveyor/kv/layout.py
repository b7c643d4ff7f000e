"""How a model's layers share the KV cache: layer groups with one block table each.

A model whose layers all attend to the whole context has one group: a block holds every layer's
K/V for `block_size` tokens, as it always did. A model with sliding-window layers (Gemma 3: five
local layers to one global; Mistral v0.1: all local) splits its layers into groups of equal size,
each group of one window (0: global). Every group draws its blocks from the same pool, and a block
id addresses the same bytes whatever the group: the cache tensor's leading axis has one *slot* per
layer of a group, and layer `i` reads slot ``layer_slot[i]`` through its group's block table. A
group of local layers gives a block back as soon as no later query can see it (it left the
window), so a long sequence holds its global layers' blocks plus a window's worth per local group,
not every layer's blocks for every token. Groups of one kind are padded to the group size when the
counts do not divide (a padded slot is allocated and never written).

The manager keeps a request's tables interleaved in one list: logical block `b` of group `g` is
entry ``b * num_groups + g`` (so a table grows by `num_groups` entries per logical block and the
runner's deltas stay appends). A block a local group gave back becomes `null_block`, an extra,
never-written block of zeros past the pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVLayout:
    windows: tuple[int, ...]       # per group: 0 = global, else the tokens its layers attend to
    layer_group: tuple[int, ...]   # per layer: its group
    layer_slot: tuple[int, ...]    # per layer: its slot (index along the cache's leading axis)
    slots: int                     # layers per group (the cache's leading axis)

    @staticmethod
    def single(num_layers: int, window: int = 0) -> KVLayout:
        """Every layer in one group (no window: the classic layout)."""
        return KVLayout((window,), (0,) * num_layers, tuple(range(num_layers)), num_layers)

    @staticmethod
    def from_config(cfg: Any, hybrid: bool = True) -> KVLayout:
        """Groups by window (global first), each of the size of the smallest kind; `hybrid` False:
        one global group whatever the windows (their layers mask what they do not see). `cfg`: a
        ModelConfig (its num_hidden_layers and layer_window(i))."""
        windows = [cfg.layer_window(i) if hybrid else 0 for i in range(cfg.num_hidden_layers)]
        kinds = sorted(set(windows))
        if len(kinds) == 1:
            return KVLayout.single(len(windows), kinds[0])
        size = min(windows.count(w) for w in kinds)
        group_windows: list[int] = []
        layer_group = [0] * len(windows)
        layer_slot = [0] * len(windows)
        for w in kinds:
            first = len(group_windows)
            members = [i for i, lw in enumerate(windows) if lw == w]
            group_windows.extend([w] * cdiv(len(members), size))
            for n, i in enumerate(members):
                layer_group[i], layer_slot[i] = first + n // size, n % size
        return KVLayout(tuple(group_windows), tuple(layer_group), tuple(layer_slot), size)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def windowed(self) -> bool:
        """Some group gives blocks back (the cache needs a null block)."""
        return any(self.windows)

    @property
    def trivial(self) -> bool:
        """One global group: block tables as they always were."""
        return self.windows == (0,)

    def window_blocks(self, window: int, block_size: int) -> int:
        """The most blocks a query's window can span."""
        return cdiv(window - 1, block_size) + 1

    def dropped(self, window: int, num_computed: int, block_size: int) -> int:
        """Leading blocks of a group with this window that no query from position `num_computed`
        on can see (its keys are at positions > query - window)."""
        return max(0, (num_computed - window + 1) // block_size) if window else 0

    def blocks_for(self, num_tokens: int, block_size: int, num_computed: int | None = None, chunk: int = 1) -> int:
        """Blocks a sequence of `num_tokens` holds in all groups: once `num_computed` of them are
        computed (while its next chunk runs), or, with None, at most over its life, running chunks
        of up to `chunk` tokens (1: decoding)."""
        n = cdiv(num_tokens, block_size)
        total = 0
        for w in self.windows:
            if not w:
                total += n
            elif num_computed is None:
                total += min(n, self.window_blocks(w + chunk - 1, block_size))
            else:
                total += n - min(n, self.dropped(w, num_computed, block_size))
        return total

    def max_tokens(self, num_blocks: int, block_size: int) -> int:
        """The longest sequence whose blocks fit in `num_blocks` while it decodes."""
        if all(self.windows) and sum(self.window_blocks(w, block_size) for w in self.windows) <= num_blocks:
            return 1 << 62   # every group holds at most its window
        lo, hi = 0, num_blocks   # blocks per global group: the largest that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_for(mid * block_size, block_size) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo * block_size
