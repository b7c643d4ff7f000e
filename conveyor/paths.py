"""Where Conveyor keeps files between runs. No torch here."""

from __future__ import annotations

import os
import re
from pathlib import Path


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
