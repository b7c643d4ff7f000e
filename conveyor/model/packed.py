"""A GGUF's quantized matmul weights in the layout the kernels read, cached on disk and memory-mapped.

The int8 kernel reads its weights reordered 16 rows at a time (``quant.QuantTensor.for_int8``), and
fused matmuls (q/k/v, gate/up) concatenate their pieces: neither is the file's layout, so the file
itself cannot be mapped. Instead the first load writes every quantized matmul's final tensor (the
same bytes as the file's blocks, reordered; K-quants up to 4% more) to one safetensors file under
``cache_dir()/packed``, and every later load maps that file (safetensors maps it; nothing is
copied) instead of reading and reordering the GGUF's blocks, and the first load swaps its own
tensors for the mapped ones too. So:

- a start reads the weights' pages only as they are first used, and does not reorder anything
  (an 8B Q4_K_M: seconds instead of tens of seconds);
- processes serving the same file (``--data-parallel-size N`` replicas, or several servers) share
  one copy of the weights in the page cache instead of holding one each;
- while loading, the file's blocks and their reordered copy no longer coexist in memory.

The cache costs the file's size once more on disk (one cache per GGUF file name: a new one replaces
the others). Its name holds the GGUF's key (size, mtime, first MiB), the types computed as stored,
the layout choice (int8 or not) and a digest of the kernels' source that defines the layouts, so a
changed file or layout is never read from an old cache.
``CONVEYOR_PACKED_WEIGHTS=off`` keeps everything in memory, as before.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
from pathlib import Path

import safetensors
import safetensors.torch
import torch
from torch import nn

from conveyor.model.probe_cache import _file_lock
from conveyor.model.quant import QuantTensor
from conveyor.paths import cache_dir, gguf_file_key

log = logging.getLogger(__name__)

VERSION = 1   # bump when what a key names changes (the layouts themselves are covered by the digest)
_LAYOUT_SOURCE = Path(__file__).parent / "csrc" / "quant_cpu.cpp"   # defines the x16 layouts


def enabled() -> bool:
    return os.environ.get("CONVEYOR_PACKED_WEIGHTS", "on") != "off"


class PackedWeights:
    """The packed tensors of one model load: read from the cache (``hit``), or recorded as
    ``use_quantized`` builds them and then saved and mapped (``save_and_map``). Keys are module paths
    ("layers.3.mlp.gate_up_proj.0": part 0 of a fused matmul; "embed_tokens"; "lm_head")."""

    def __init__(self, file: Path):
        self.file = file
        self.tensors: dict[str, QuantTensor] = {}
        self.sources: set[str] = set()   # the file's tensor names (HF, without "model.") they replace
        self.modules: dict[str, list[nn.Module]] = {}   # on a miss: who holds each tensor (to map it later)
        self.hit = False
        self._lock: contextlib.ExitStack | None = None

    @classmethod
    def open(cls, gguf: Path, native: tuple[str, ...], int8: bool) -> PackedWeights | None:
        """The cache of `gguf` loaded with `native` types as stored and int8 activations or not:
        mapped if it exists and reads back, else an empty one to fill. None when disabled."""
        if not enabled():
            return None

        layout = hashlib.sha256(_LAYOUT_SOURCE.read_bytes()).hexdigest()[:8]
        digest = hashlib.sha256(f"{VERSION}:{','.join(sorted(native))}:{int8}:{layout}".encode()).hexdigest()[:12]
        packed = cls(cache_dir() / "packed" / f"{gguf.stem}-{gguf_file_key(gguf)}-{digest}.safetensors")
        if packed._try_map():
            return packed
        # A miss: hold the file's lock until it is written (save_and_map), so that replicas starting
        # together take turns -- the first packs, the others map its file (one copy for all).
        packed._lock = contextlib.ExitStack()
        packed._lock.enter_context(_file_lock(packed.file))
        if packed._try_map():   # written while this process waited
            packed.release()
        return packed

    def release(self) -> None:
        """Let other processes at the cache file (after save_and_map, or when the load failed)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _try_map(self) -> bool:
        if not self.file.exists():
            return False
        try:
            self._map()
            self.hit = True
        except Exception as e:  # noqa: BLE001 - a damaged or foreign file: rebuild it
            log.warning("packed weights cache %s unreadable (%s): reading the GGUF again", self.file, e)
            self.tensors.clear()
            self.sources.clear()
        return self.hit

    def _map(self) -> None:
        with safetensors.safe_open(str(self.file), framework="pt") as f:
            meta = json.loads(f.metadata()["conveyor"])
            self.tensors = {k: QuantTensor(f.get_tensor(k), m["qtype"], int(m["in_features"]))
                            for k, m in meta["tensors"].items()}
            self.sources = set(meta["sources"])

    def parts(self, key: str) -> list[QuantTensor] | None:
        """The cached tensors of module `key` (its parts in order), or None."""
        if key in self.tensors:
            return [self.tensors[key]]
        found = []
        while f"{key}.{len(found)}" in self.tensors:
            found.append(self.tensors[f"{key}.{len(found)}"])
        return found or None

    def record(self, key: str, weight: QuantTensor, module: nn.Module, sources: list[str]) -> None:
        """On a miss: `module` holds `weight` (module `key`), made from the file's tensors `sources`."""
        if key not in self.tensors:
            self.tensors[key] = weight
        self.modules.setdefault(key, []).append(module)
        self.sources.update(sources)

    def save_and_map(self) -> None:
        """Write the recorded tensors (atomically, under the file's lock), then point their modules
        at the mapped file, so that this process too holds them once, shared with later ones."""
        if self.hit or not self.tensors:
            return
        meta = {"tensors": {k: {"qtype": w.qtype, "in_features": w.in_features} for k, w in self.tensors.items()},
                "sources": sorted(self.sources)}
        tmp = self.file.with_name(f"{self.file.name}.tmp{os.getpid()}")
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            safetensors.torch.save_file({k: w.data.contiguous() for k, w in self.tensors.items()}, str(tmp),
                                        metadata={"conveyor": json.dumps(meta)})
            os.replace(tmp, self.file)
        except OSError as e:   # a full or read-only disk: keep serving from memory
            log.warning("packed weights cache not written (%s)", e)
            tmp.unlink(missing_ok=True)
            return
        stem = self.file.name.rsplit("-", 2)[0]
        for old in self.file.parent.glob(f"{glob.escape(stem)}-*.safetensors"):
            if old != self.file and old.name.rsplit("-", 2)[0] == stem:
                old.unlink(missing_ok=True)   # one cache per file name: an older file, layout or choice
                old.with_suffix(".lock").unlink(missing_ok=True)
        recorded = self.modules
        self._map()
        for key, modules in recorded.items():
            for m in modules:
                m.qweight = self.tensors[key].data
        self.modules = {}
        log.info("packed weights cached in %s (%.1f MiB; mapped from there)", self.file,
                 sum(w.data.numel() for w in self.tensors.values()) / 2**20)
