"""Where Conveyor keeps files between runs. No torch here."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

GGUF_CONVERSION_VERSION = 3   # bump when the cached layout of a converted GGUF changes


def cache_dir() -> Path:
    """``$CONVEYOR_CACHE_DIR``, default ``~/.cache/conveyor``: converted GGUF weights, cost profiles."""
    return Path(os.environ.get("CONVEYOR_CACHE_DIR", Path.home() / ".cache" / "conveyor"))


def profile_path(model_name: str, dtype: str, threads: int | None = None) -> Path:
    """Where `conveyor profile` saves, and the engine looks for, this model's cost profile; with
    `threads`, the one measured with that many torch threads (``<model>-<dtype>-<N>threads.json``:
    `conveyor profile --torch-threads N` saves there, and an engine running N threads takes it
    before the plain one, since one thread's steps cost 1.3-1.9x two threads' on a 2-vCPU VM)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", model_name)
    suffix = f"-{threads}threads" if threads else ""
    return cache_dir() / "profiles" / f"{safe}-{dtype}{suffix}.json"


def gguf_file_key(path: Path) -> str:
    """A short key for a GGUF file's caches (its conversion, its packed weights): the conversion
    version, the file's size and mtime, and its first MiB."""
    st = path.stat()
    h = hashlib.sha256(f"{GGUF_CONVERSION_VERSION}:{st.st_size}:{st.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]
