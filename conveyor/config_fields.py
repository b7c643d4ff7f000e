"""Config dataclass fields that carry their own help text, and the checks they share.

The engine's and the server's options are written once, as dataclass fields made with ``option()``;
the ``conveyor`` command lines (``add_options``) and ``LLM(...)`` keywords are generated from them
(see conveyor/config.py and conveyor/server/config.py). No torch here.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from dataclasses import field, fields
from typing import Any


def option(default: Any, help: str, *, choices: tuple[str, ...] | None = None, cli: bool = True,
           env: str | None = None, metavar: str | None = None) -> Any:
    """A dataclass field with its command-line help (`cli=False`: not a command-line flag; `env`: the
    flag's default is this environment variable when it is set)."""
    return field(default=default, metadata={"help": help, "choices": choices, "cli": cli, "env": env,
                                            "metavar": metavar})


def add_options(group: argparse._ActionsContainer, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One flag per ``option()`` field of the dataclass `cls` (``--max-num-seqs`` for max_num_seqs), but
    those in `skip`: bool fields are --x / --no-x, ``list[...]`` fields take one or more values."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        meta = f.metadata
        if not meta or not meta.get("cli") or f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = (os.environ.get(meta["env"]) or f.default) if meta.get("env") else f.default   # "" is unset
        kind = _flag_type(hints[f.name])
        extra = {"metavar": meta["metavar"]} if meta.get("metavar") else {}
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=meta["help"])
        elif typing.get_origin(kind) is list:
            (item,) = typing.get_args(kind)
            group.add_argument(flag, nargs="+", type=item, default=default, choices=meta["choices"],
                               help=meta["help"], **extra)
        else:
            group.add_argument(flag, type=kind, default=default, choices=meta["choices"], help=meta["help"], **extra)


def options_from_args(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The values of `cls`'s fields that parsed flags (from add_options) carry."""
    return {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}


def _flag_type(hint: Any) -> Any:
    """int for `int` or `int | None`, and so on."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return hint


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
