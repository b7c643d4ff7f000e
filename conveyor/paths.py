"""Where Conveyor keeps files between runs. No torch here."""

from __future__ import annotations

import os
import re
from pathlib import Path


def cache_dir() -> Path:
    """``$CONVEYOR_CACHE_DIR``, default ``~/.cache/conveyor``: converted GGUF weights, cost profiles."""
    return Path(os.environ.get("CONVEYOR_CACHE_DIR", Path.home() / ".cache" / "conveyor"))


def profile_path(model_name: str, dtype: str) -> Path:
    """Where `conveyor profile` saves, and the engine looks for, this model's cost profile."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", model_name)
    return cache_dir() / "profiles" / f"{safe}-{dtype}.json"
