"""Decisions measured on this machine, remembered: the same command gives the same engine.

Some kernel paths are chosen by timing them at start-up (whether oneDNN prepacking beats
``F.linear`` for a shape, up to how many tokens the C++ GEMV wins, whether ``dtype="auto"``'s
bf16 really runs fast here). On a busy machine a timing can come out the other way, and another
path rounds differently: a restart of the same command could change greedy outputs. So the first
measurement on a machine is written to ``cache_dir()/probes/<machine>.json`` and every later
start reads it back. The machine key is the CPU model, its SIMD flags, the thread count and the
torch version: change any of them and the probes run again.

``CONVEYOR_PROBES``: ``cache`` (default) as above; ``fresh`` measures again and overwrites the
remembered answers (once per process and probe); ``off`` neither reads nor writes the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from conveyor.paths import cache_dir

logger = logging.getLogger(__name__)

T = TypeVar("T")
VERSION = 1   # bump when a probe's meaning changes: old answers are then measured again
# Flags that change which kernels exist or how fast they run.
KEY_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "avx_vnni")
_lock = threading.Lock()


def cpu_info() -> tuple[str, set[str]]:
    """(model name, flags) from /proc/cpuinfo; ("unknown", set()) where there is none."""
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            if model != "unknown" and flags:
                break
    except OSError:
        pass
    return model, flags


def machine_key() -> dict:
    import torch

    model, flags = cpu_info()
    return {"cpu": model, "flags": sorted(flags & set(KEY_FLAGS)), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "version": VERSION}


def probes_path() -> Path:
    key = machine_key()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "probes" / f"{digest}.json"


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict) and isinstance(data.get("decisions"), dict):
            return data
    except (OSError, ValueError):
        pass
    return {"machine": machine_key(), "decisions": {}}


_fresh_done: set[str] = set()


def remembered(name: str, measure: Callable[[], T]) -> T:
    """`measure()`'s answer for `name` on this machine: measured once, then read back (a JSON value)."""
    mode = os.environ.get("CONVEYOR_PROBES", "cache")
    if mode == "off":
        return measure()
    path = probes_path()
    with _lock:
        if mode != "fresh" or name in _fresh_done:
            decisions = _read(path)["decisions"]
            if name in decisions:
                return decisions[name]
    value = measure()
    with _lock:
        data = _read(path)
        data["decisions"][name] = value
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            os.replace(tmp, path)   # atomic: a concurrent start reads the old file or the new one
        except OSError as e:   # a read-only home: measured every start, as before
            logger.warning("cannot remember probe %s in %s: %s", name, path, e)
        if mode == "fresh":
            _fresh_done.add(name)
    logger.info("probe %s measured on this machine: %s (remembered in %s)", name, value, path)
    return value


def decisions() -> dict:
    """Every remembered decision for this machine (for benchmark records), with the machine key."""
    with _lock:
        return _read(probes_path())
