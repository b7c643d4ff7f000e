"""Batch inference on ray.data: Conveyor's in-process engine as an actor-pool ``map_batches`` stage.

    import ray
    from conveyor.ray.data import ConveyorProcessor, process

    ds = ray.data.read_json("prompts.jsonl")           # a "prompt" (text) or "prompt_token_ids" column
    out = process(ds, {"model": "path/to/model"}, concurrency=2, batch_size=32,
                  sampling_params={"temperature": 0, "max_tokens": 64})
    out.write_json("results/")

Each actor of the pool loads one engine (``conveyor.LLM``) once and runs every batch it gets through
it (continuous batching inside the batch). Rows carry either text (``prompt``) or token ids
(``prompt_token_ids``: so the chat-template and tokenize stages of ``ray.data.llm`` can run before
this one), and optionally their own ``sampling_params`` (a dict of SamplingParams fields; a ``seed``
there makes sampling reproducible whatever batch or actor the row lands in). Output columns:
``generated_text``, ``generated_token_ids``, ``num_generated_tokens``, ``num_input_tokens``,
``finish_reason`` beside the input columns.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import numpy as np

from conveyor.sampling.params import SamplingParams

OUTPUT_COLUMNS = ("generated_text", "generated_token_ids", "num_generated_tokens", "num_input_tokens",
                  "finish_reason")


class ConveyorProcessor:
    """A ``map_batches`` callable class: ``engine_options`` are ``LLM(**engine_options)``'s (model,
    dtype, max_num_seqs, ...); `sampling_params` the default for rows without their own."""

    def __init__(self, engine_options: dict | None = None, sampling_params: dict | None = None,
                 prompt_column: str = "prompt", token_ids_column: str = "prompt_token_ids",
                 params_column: str = "sampling_params"):
        from conveyor.engine.llm import LLM   # lazy: keeps torch out of the ray.data driver (the actors load it)

        self.llm = LLM(**(engine_options or {}))
        self.default = dict(sampling_params or {})
        self.prompt_column, self.token_ids_column, self.params_column = prompt_column, token_ids_column, params_column

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        n = len(next(iter(batch.values()))) if batch else 0
        prompts: list[Any] = []
        params: list[SamplingParams] = []
        for i in range(n):
            ids = batch.get(self.token_ids_column)
            if ids is not None and ids[i] is not None:
                prompts.append({"prompt_token_ids": [int(t) for t in ids[i]]})
            else:
                prompts.append(str(batch[self.prompt_column][i]))
            own = batch.get(self.params_column)
            row = own[i] if own is not None and own[i] is not None else {}
            params.append(SamplingParams(**{**self.default, **_plain(row)}))
        outs = self.llm.generate(prompts, params, use_tqdm=False) if n else []
        result = dict(batch)
        result["generated_text"] = np.array([o.outputs[0].text for o in outs], dtype=object)
        result["generated_token_ids"] = _object_array([list(o.outputs[0].token_ids) for o in outs])
        result["num_generated_tokens"] = np.array([len(o.outputs[0].token_ids) for o in outs], dtype=np.int64)
        result["num_input_tokens"] = np.array([len(o.prompt_token_ids) for o in outs], dtype=np.int64)
        result["finish_reason"] = np.array([o.outputs[0].finish_reason for o in outs], dtype=object)
        return result

    def __del__(self):
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.close()


def process(ds: Any, engine_options: dict | None = None, *, sampling_params: dict | None = None,
            concurrency: int | tuple[int, int] = 1, batch_size: int = 64, num_cpus: float = 1,
            num_gpus: float = 0, **processor_kwargs: Any) -> Any:
    """`ds` with the generated columns: an actor pool of `concurrency` engines (a (min, max) pair lets
    ray.data autoscale it), `num_cpus`/`num_gpus` each."""
    return ds.map_batches(ConveyorProcessor, batch_size=batch_size, concurrency=concurrency, num_cpus=num_cpus,
                          num_gpus=num_gpus or None, batch_format="numpy",
                          fn_constructor_kwargs={"engine_options": engine_options, "sampling_params": sampling_params,
                                                 **processor_kwargs})


def _int_fields() -> frozenset[str]:
    return frozenset(f.name for f in fields(SamplingParams) if "int" in str(f.type) and "float" not in str(f.type))


_INT_FIELDS = _int_fields()


def _plain(row: Any) -> dict:
    """A row's sampling params (a dict, maybe with numpy scalars/arrays from Arrow) as plain Python;
    Arrow turns an int column with nulls into floats: integer fields are made ints again."""
    out = {}
    for k, v in dict(row).items():
        if v is None:
            continue
        if isinstance(v, np.ndarray):
            v = v.tolist()
        elif isinstance(v, np.generic):
            v = v.item()
        if k in _INT_FIELDS and isinstance(v, float) and v.is_integer():
            v = int(v)
        out[k] = v
    return out


def _object_array(rows: list[list[int]]) -> np.ndarray:
    arr = np.empty(len(rows), dtype=object)
    for i, r in enumerate(rows):
        arr[i] = np.array(r, dtype=np.int64)
    return arr
