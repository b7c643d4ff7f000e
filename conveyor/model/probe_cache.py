"""Decisions measured on this machine, remembered: the same command gives the same engine.

Some kernel paths are chosen by timing them at start-up (whether oneDNN prepacking beats
``F.linear`` for a shape, up to how many tokens the C++ GEMV wins, whether ``dtype="auto"``'s
bf16 really runs fast here). On a busy machine a timing can come out the other way, and another
path rounds differently: a restart of the same command could change greedy outputs. So the first
measurement on a machine is written to ``cache_dir()/probes/<machine>.json`` and every later
start reads it back. The machine key is the CPU model, its SIMD flags, the thread count and the
torch version: change any of them and the probes run again.

Processes starting together (data-parallel or Ray replicas) take turns under a file lock, and
the first measurement is every one's, so the replicas of one server run the same paths.
``CONVEYOR_PROBES_DIR`` moves the file (the tests give each session its own).
``CONVEYOR_PROBES``: ``cache`` (default) as above; ``fresh`` measures again and overwrites the
remembered answers (once per process and probe); ``off`` neither reads nor writes the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import torch

from conveyor.paths import cache_dir

try:
    import fcntl
except ImportError:   # no flock here (Windows): the thread lock still holds
    fcntl = None

logger = logging.getLogger(__name__)

T = TypeVar("T")
VERSION = 2   # bump when a probe's meaning changes: old answers are then measured again
# Flags that change which kernels exist or how fast they run.
KEY_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "avx_vnni")
_lock = threading.Lock()
_held = threading.local()


def _first_processor() -> dict[str, str]:
    """/proc/cpuinfo's fields of the first processor (every one reports the same model and flags);
    empty where there is none."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_info() -> tuple[str, set[str]]:
    """(model name, flags) from /proc/cpuinfo; ("unknown", set()) where there is none. With
    ``$CONVEYOR_CPU_FLAGS`` (a list of flags, e.g. "avx2 fma f16c") only those of the CPU's flags:
    the kernels are then built for, and every feature-based choice made as on, a CPU that has no
    more (to run the AVX2 paths on an AVX-512 machine, or to build for the least CPU of a fleet)."""
    fields = _first_processor()
    flags = set(fields.get("flags", "").split())
    if (allowed := os.environ.get("CONVEYOR_CPU_FLAGS")) is not None:
        flags &= set(allowed.replace(",", " ").split())
    return fields.get("model name") or "unknown", flags


def cpu_family() -> str:
    """A short name of the CPU's family, for per-CPU records (benchmark results, docs tables):
    what decides which kernels exist and how MKL and oneDNN behave. From /proc/cpuinfo's vendor,
    family and model numbers and flags; "unknown" where there is none."""
    fields = _first_processor()
    if not fields:
        return "unknown"
    flags = set(fields.get("flags", "").split())
    vendor, family = fields.get("vendor_id", ""), int(fields.get("cpu family", "0") or 0)
    if vendor == "AuthenticAMD":
        name = {23: "AMD Zen/Zen2", 25: "AMD Zen4" if "avx512f" in flags else "AMD Zen3", 26: "AMD Zen5"}.get(
            family, f"AMD family {family}")
    elif vendor == "GenuineIntel":
        name = "Intel AMX" if "amx_bf16" in flags else "Intel AVX-512" if "avx512f" in flags else "Intel"
    else:
        name = vendor or "unknown"
    isa = "AMX" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else \
        "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{name} ({isa}; family {family} model {fields.get('model', '?')})"


def machine_key() -> dict:
    model, flags = cpu_info()
    return {"cpu": model, "flags": sorted(flags & set(KEY_FLAGS)), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "version": VERSION}


def probes_path() -> Path:
    """``$CONVEYOR_PROBES_DIR`` (default ``cache_dir()/probes``) / a digest of the machine key."""
    key = machine_key()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    folder = os.environ.get("CONVEYOR_PROBES_DIR")
    return (Path(folder) if folder else cache_dir() / "probes") / f"{digest}.json"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Held across read, measure and write: engine replicas starting together (data parallel, Ray)
    take turns, so the first one's measurement is every one's (and they do not time each other)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path.with_suffix(".lock"), "a+")
    except OSError:   # a read-only cache: no lock, no file (measured every start)
        yield
        return
    with f:
        try:
            if fcntl is not None:
                fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:   # no flock on this file system: the thread lock still holds
            pass
        yield


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
    if mode == "off" or getattr(_held, "on", False):   # (a probe measured inside another's: not remembered)
        return measure()
    path = probes_path()
    with _lock, _file_lock(path):
        _held.on = True
        try:
            return _remembered(name, measure, mode, path)
        finally:
            _held.on = False


def _remembered(name: str, measure: Callable[[], T], mode: str, path: Path) -> T:
    """Under both locks: the file's answer (another process may have measured it while we waited),
    or a measurement, written back atomically."""
    if mode != "fresh" or name in _fresh_done:
        decisions = _read(path)["decisions"]
        if name in decisions:
            return decisions[name]
    value = measure()
    data = _read(path)
    data["decisions"][name] = value
    try:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)   # atomic: a reader without the lock sees the old file or the new one
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
