"""Config dataclass fields that carry their own help text, and the checks they share.

The engine's options are written once, as dataclass fields made with ``option()``; the
``conveyor`` command lines and ``LLM(...)`` keywords are generated from them (see
conveyor/config.py). No torch here.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


def option(default: Any, help: str, *, choices: tuple[str, ...] | None = None, cli: bool = True) -> Any:
    """A dataclass field with its command-line help (`cli=False`: not a command-line flag)."""
    return field(default=default, metadata={"help": help, "choices": choices, "cli": cli})


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
