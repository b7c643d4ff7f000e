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

The engine actors hold their CPUs for the whole run, so a pool that takes every CPU of the cluster
leaves none for the read and write tasks (1 CPU each, ray.data's default) and the pipeline never
starts: ``process`` sizes the actors to leave room for one such task, or refuses at once.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import numpy as np

from conveyor.sampling.params import SamplingParams

OUTPUT_COLUMNS = ("generated_text", "generated_token_ids", "num_generated_tokens", "num_input_tokens",
                  "finish_reason")
IO_CPUS = 1.0            # what a read or write task reserves (ray.data's default)
MIN_ENGINE_CPUS = 0.1    # below this an engine actor's share is a rounding error: refuse instead


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
            concurrency: int | tuple[int, ...] = 1, batch_size: int = 64, num_cpus: float | None = None,
            num_gpus: float = 0, io_cpus: float = IO_CPUS, **processor_kwargs: Any) -> Any:
    """`ds` with the generated columns: an actor pool of `concurrency` engines (a (min, max) pair lets
    ray.data autoscale it), `num_cpus`/`num_gpus` each. `num_cpus` None: 1, or less when the pool
    and one read/write task of `io_cpus` (what the pipeline's I/O tasks reserve) would not fit the
    cluster's CPUs together; ValueError when they cannot fit at all."""
    num_cpus = engine_cpus(max_engines(concurrency), cluster_cpus(), num_cpus, io_cpus)
    return ds.map_batches(ConveyorProcessor, batch_size=batch_size, concurrency=concurrency, num_cpus=num_cpus,
                          num_gpus=num_gpus or None, batch_format="numpy",
                          fn_constructor_kwargs={"engine_options": engine_options, "sampling_params": sampling_params,
                                                 **processor_kwargs})


def max_engines(concurrency: int | tuple[int, ...]) -> int:
    """The most actors a pool of `concurrency` runs (ray.data: n, (min, max) or (min, max, initial))."""
    return int(concurrency[1] if isinstance(concurrency, (tuple, list)) else concurrency)


def cluster_cpus() -> float:
    import ray   # lazy: optional dependency (ray)

    if not ray.is_initialized():   # ray.data would start it on the first read anyway
        ray.init()
    return float(ray.cluster_resources().get("CPU", 0.0))


def engine_cpus(engines: int, total: float, requested: float | None = None, io_cpus: float = IO_CPUS) -> float:
    """CPUs each of `engines` actors reserves so that they and one read/write task of `io_cpus` fit
    in `total`: `requested`, or by default 1 or the even share of what the task leaves. A Ray CPU is
    a reservation, not a core: the engine's torch threads are set apart (``torch_threads``)."""
    if requested == 0:   # no reservation at all (oversubscribing on purpose): nothing to fit
        return 0.0
    room = total - io_cpus
    per_engine = requested if requested is not None else min(1.0, room / engines)
    if per_engine < MIN_ENGINE_CPUS or engines * per_engine > room + 1e-9:
        need = engines * max(per_engine, MIN_ENGINE_CPUS) + io_cpus
        raise ValueError(f"{engines} engine actor(s) x {max(per_engine, MIN_ENGINE_CPUS):g} CPU and one "
                         f"read/write task ({io_cpus:g} CPU) need {need:g} CPUs; the cluster has {total:g}. "
                         f"Run fewer engines (concurrency) or give each fewer CPUs (num_cpus).")
    return per_engine


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
