"""Linear layers on oneDNN prepacked weights (CPU), where that measures faster than torch's own.

``torch.ops.mkldnn._reorder_linear_weight`` lays a weight out once in oneDNN's blocked format
(AMX tiles where the CPU has them); ``_linear_pointwise`` then multiplies without repacking it
on every call — the part that dominates small-batch matmuls. Whether it pays is measured once
per process and dtype on the model's own shapes (it does for bf16 on AMX CPUs, by 1.5-2x at
decode batch sizes; for fp32 it is about even), since the CPUs of these machines vary.
"""

from __future__ import annotations

import logging
import os
import time
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


def _ops_available() -> bool:
    return hasattr(torch.ops, "mkldnn") and hasattr(torch.ops.mkldnn, "_linear_pointwise") \
        and torch.backends.mkldnn.is_available()


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _time(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t) / repeats


@cache
def _measured(dtype: torch.dtype, in_features: int, out_features: int) -> bool:
    if not _ops_available():
        return False
    try:
        w = torch.randn(out_features, in_features, dtype=dtype)
        pw = pack(w)
        ok = True
        for tokens in (1, 32):
            x = torch.randn(tokens, in_features, dtype=dtype)
            ok = ok and torch.allclose(packed_linear(x, pw, None).float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-1)
            ok = ok and _time(lambda: packed_linear(x, pw, None)) < 0.9 * _time(lambda: F.linear(x, w))
        logger.info("prepacked oneDNN linear for %s: %s", dtype, "faster, used" if ok else "not faster, not used")
        return ok
    except Exception as e:   # noqa: BLE001 - an op missing or refusing this dtype: plain F.linear
        logger.info("prepacked oneDNN linear unavailable for %s: %s", dtype, e)
        return False


def prefer_packed(device: torch.device | str, dtype: torch.dtype, in_features: int, out_features: int) -> bool:
    """Use prepacked weights for this dtype? (CPU only; measured once per process and shape;
    CONVEYOR_PACKED_LINEAR=off turns them off, for comparisons.)"""
    if os.environ.get("CONVEYOR_PACKED_LINEAR", "auto") == "off":
        return False
    return torch.device(device).type == "cpu" and _measured(dtype, in_features, out_features)


class PackedLinear(nn.Module):
    """An nn.Linear whose weight lives only in oneDNN's prepacked layout (the plain copy is freed)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack(linear.weight)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)


def pack_linears(module: nn.Module) -> int:
    """Replace every nn.Linear below `module` by a PackedLinear; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child))
            count += 1
        else:
            count += pack_linears(child)
    return count
