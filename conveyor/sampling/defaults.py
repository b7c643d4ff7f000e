"""A model's default sampling parameters: vLLM's ``--generation-config`` and
``--override-generation-config``.

A request's own fields always win; these fill only the fields it leaves out (temperature, top_p,
top_k, min_p, repetition_penalty, and max_tokens, which is still capped by the context left).
Where they come from (``generation_config``):

- ``auto`` (the default): the model's own recommendation. An HF directory: its
  ``generation_config.json`` (``max_new_tokens`` is max_tokens; other keys, ``do_sample``
  included, are ignored, as vLLM does). A GGUF file: its ``general.sampling.*`` metadata, then a
  ``generation_config.json`` in the same folder (it wins). The demo model, which has neither,
  gets ``DEMO_DEFAULTS`` (greedy: see there why).
- ``vllm``: none (the OpenAI/vLLM neutral defaults: temperature 1, top_p 1, ...).
- a path: a folder holding ``generation_config.json``, or that JSON file itself.

``override_generation_config`` (a JSON object, or a dict offline) is merged over whichever of
these applies; with ``vllm`` it is all there is. No torch here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gguf import GGUFReader

from conveyor.paths import cache_dir, gguf_file_key
from conveyor.sampling.params import SamplingParams

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")
HF_NAMES = {"max_new_tokens": "max_tokens"}   # generation_config.json's name -> the request field
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}
# The demo model (SmolLM2-135M-Instruct) answers greedily by default. At temperature 1 the 135M model
# rambles (issue 58: "What is the capital of France?" answered in broken French); even at its model
# card's temperature 0.2 / top_p 0.9 the first token is nearly a coin toss ("The" -1.88 against
# "L'Étoile..." -1.97 in logprob), and 37 of 60 seeds named Paris; greedy answers "The capital of France
# is Paris." (a repetition penalty of 1.1-1.2 made the other test questions' answers worse).
DEMO_DEFAULTS = {"temperature": 0.0}
NEUTRAL = "vllm"


def _known(values: dict[str, Any], where: str, strict: bool) -> dict[str, Any]:
    """The sampling fields among `values` (HF names mapped); `strict`: any other key is an error."""
    out, unknown = {}, []
    for key, value in values.items():
        name = HF_NAMES.get(key, key)
        if name in FIELDS:
            out[name] = value
        elif strict:
            unknown.append(key)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}; the fields are "
                         f"{', '.join(FIELDS)} (or max_new_tokens)")
    return out


def _read_json(path: Path, where: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{where}: {path} is not a JSON object")
    return data


def _generation_config(path: Path) -> dict[str, Any]:
    """The sampling fields of a generation_config.json (its other keys ignored)."""
    return _known(_read_json(path, "generation config"), "", False)


def _gguf_sampling(path: Path) -> dict[str, Any]:
    """The ``general.sampling.*`` defaults a GGUF file's metadata carries (llama.cpp reads the same keys),
    cached by the file's key: parsing the demo file's metadata took 1.9 s, at every engine start."""
    cached = cache_dir() / "gguf-sampling" / f"{path.stem}-{gguf_file_key(path)}.json"
    if cached.exists():
        return json.loads(cached.read_text())
    out = {GGUF_KEYS[k]: f.contents() for k, f in GGUFReader(path).fields.items() if k in GGUF_KEYS and f.types}
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")   # replicas starting together: no half-written file
    tmp.write_text(json.dumps(out))
    os.replace(tmp, cached)
    return out


def model_defaults(model_path: Path, is_demo: bool) -> tuple[dict[str, Any], str]:
    """`auto`: the model's own defaults and where they came from ('' where it has none)."""
    if model_path.is_dir():
        gen = model_path / "generation_config.json"
        if gen.exists():
            return _generation_config(gen), str(gen)
        return {}, ""
    values, where = {}, []
    if model_path.suffix == ".gguf":
        values = _gguf_sampling(model_path)
        where = ["the GGUF's general.sampling metadata"] if values else []
    beside = model_path.parent / "generation_config.json"
    if beside.exists():
        values.update(_generation_config(beside))
        where.append(str(beside))
    if not where and is_demo:
        return dict(DEMO_DEFAULTS), "the demo model's built-in defaults"
    return values, " and ".join(where)


def generation_defaults(setting: str, model_path: Path, is_demo: bool = False,
                        override: str | dict | None = None) -> tuple[dict[str, Any], str]:
    """The default sampling fields for this model and where they came from; ValueError if the setting,
    the file or a value is wrong (checked as SamplingParams would check a request's)."""
    if setting == NEUTRAL:
        values, source = {}, ""
    elif setting == "auto":
        values, source = model_defaults(model_path, is_demo)
    else:
        path = Path(setting).expanduser()
        file = path / "generation_config.json" if path.is_dir() else path
        if not file.exists():
            raise ValueError(f"generation_config: no such file or folder {setting!r} (give auto, vllm, a folder "
                             "with generation_config.json, or the JSON file)")
        values, source = _generation_config(file), str(file)
    if override:
        if isinstance(override, str):
            try:
                override = json.loads(override)
            except ValueError as e:
                raise ValueError(f"override_generation_config is not JSON: {e}") from e
        if not isinstance(override, dict):
            raise ValueError("override_generation_config must be a JSON object, e.g. '{\"temperature\": 0.5}'")
        values = {**values, **_known(override, "override_generation_config", True)}
        source = f"{source} with overrides" if source else "overrides"
    try:
        SamplingParams(**values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"default sampling parameters from {source}: {e}") from e
    return values, source


def describe(values: dict[str, Any], source: str) -> str:
    """The start-up log line."""
    if not values:
        return "default sampling parameters: none (a request's omitted fields take the neutral defaults)"
    shown = ", ".join(f"{k}={values[k]}" for k in FIELDS if k in values)
    return (f"default sampling parameters from {source}: {shown} (used where a request omits the field; "
            "--generation-config vllm turns them off)")
