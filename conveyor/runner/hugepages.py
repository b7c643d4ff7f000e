"""Transparent huge pages for big CPU tensors (the KV cache), where the kernel allows them.

A decode step reads every sequence's KV blocks, each at a different place in a cache of
gigabytes: with 4 KiB pages nearly every block is a TLB miss and a page walk. Backing the cache
with 2 MiB pages (Linux THP in "madvise" or "always" mode) removes most of them. The memory is
advised before it is first touched, so that it is faulted in as huge pages.
CONVEYOR_HUGE_PAGES=off turns this off, for comparisons.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_MADV_HUGEPAGE = 14
_HUGE = 2 << 20


def thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
        return text.split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "never"


def empty_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape) on the CPU, on huge pages when the OS offers them."""
    if (not sys.platform.startswith("linux") or thp_mode() not in ("madvise", "always")
            or os.environ.get("CONVEYOR_HUGE_PAGES", "auto") == "off"):
        return torch.zeros(shape, dtype=dtype)
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * dtype.itemsize
    if nbytes < 4 * _HUGE:
        return torch.zeros(shape, dtype=dtype)
    # Over-allocate so that a 2 MiB-aligned stretch of the right size can be advised and used.
    raw = torch.empty(nbytes + _HUGE, dtype=torch.uint8)
    start = (raw.data_ptr() + _HUGE - 1) // _HUGE * _HUGE
    offset = start - raw.data_ptr()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(nbytes // _HUGE * _HUGE), _MADV_HUGEPAGE) != 0:
            logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
    except (OSError, AttributeError):
        pass
    out = raw[offset:offset + nbytes].view(dtype).view(shape)   # keeps `raw` alive through its storage
    out.zero_()
    return out
