"""The engine: inputs -> EngineCore (schedule -> execute -> update) -> outputs.

``Engine`` puts together what one process needs to serve a model: input processing
(tokenization and validation, before anything is registered), the ``EngineCore`` with the
``ModelRunner`` as its executor, and the ``OutputProcessor`` (detokenization, stop strings,
``n`` siblings). ``LLM`` and ``AsyncEngine`` drive it.
"""

from __future__ import annotations

import logging
import numbers
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from conveyor.config import EngineConfig
from conveyor.engine.core import EngineCore, EngineDeadError
from conveyor.engine.output_processor import OutputProcessor
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.stop_strings import compile_stops
from conveyor.engine.trace import StepTracer
from conveyor.kv.manager import KVCacheManager
from conveyor.model.dtype import resolve_dtype
from conveyor.model.loader import LoadedModel, load_model
from conveyor.paths import profile_path
from conveyor.request import Request
from conveyor.runner.kv_cache import KVCacheTensors
from conveyor.runner.model_runner import ModelRunner
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler.scheduler import Scheduler
from conveyor.sim.cost import StepCostModel, preemption_costs

__all__ = ["Engine", "EngineConfig", "EngineDeadError", "InvalidRequestError", "ProcessedInput"]

GIB = 1 << 30
logger = logging.getLogger(__name__)


class InvalidRequestError(ValueError):
    """The request cannot run here (bad prompt, too long, bad parameters); the message says why."""


@dataclass(slots=True)
class ProcessedInput:
    """A prompt tokenized and validated, with its own copy of the sampling parameters."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None   # shares prefix-cache blocks only with requests of the same salt


class Engine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None):
        self.config = config = config or EngineConfig()
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        if loaded is not None:   # a model already in memory runs in its own dtype
            dtype = loaded.model.embed_tokens.weight.dtype
        else:
            dtype = getattr(torch, resolve_dtype(config.dtype, config.device))
            if dtype == torch.float16 and torch.device(config.device).type == "cpu":
                raise ValueError("dtype float16 runs on CUDA only; on a CPU use bfloat16 or float32 (or auto)")
        self.dtype = str(dtype).removeprefix("torch.")
        tp = None
        if config.tensor_parallel_size > 1:
            if loaded is not None:
                raise ValueError("tensor parallelism loads its slices itself: pass a model path, not a loaded model")
            tp, loaded = self._start_tensor_parallel(config, dtype)
        self.loaded = loaded or load_model(config.model, config.device, dtype, tokenizer=config.tokenizer)
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.model_name = self.loaded.name
        num_blocks, num_host = kv_cache_blocks(config, self.model_config, dtype)
        # A sequence can never outgrow the whole cache: cap its length there so that a lone
        # request always fits (else it would preempt itself forever).
        self.max_model_len = min(config.max_model_len or 1 << 62, self.model_config.max_position_embeddings,
                                 num_blocks * config.block_size)
        kv = KVCacheManager(num_blocks, config.block_size, num_host, config.enable_prefix_caching)
        runner = ModelRunner(self.loaded.model, num_blocks, config.block_size, num_host, config.device, dtype)
        if tp is not None:
            runner = self._tensor_parallel_executor(runner, tp)
        self.cost_model = load_cost_model(config.cost_model, self.model_name, self.dtype)
        costs = preemption_costs(config.scheduler, self.cost_model)   # user-set costs win over the profile
        self.core = EngineCore(Scheduler(config.scheduler, kv, costs=costs), runner,
                               time.monotonic, config.max_consecutive_step_failures)
        if config.step_trace:
            self.core.tracer = StepTracer(meta={"source": "engine", "model": self.model_name,
                                                "config": asdict(config)})
        self.output_processor = OutputProcessor(self.tokenizer)
        self.grammars = grammar_backend(self.tokenizer, self.model_config.vocab_size)
        self.core.grammars = self.grammars
        self._rng = random.Random(config.seed)
        self._next_id = 0
        self._next_seq = 0
        self.last_step_time = 0.0   # seconds in the latest step(), output processing included

    @staticmethod
    def _start_tensor_parallel(config: EngineConfig, dtype: torch.dtype):
        """Start the group, tell the other ranks what to load, load rank 0's slice."""
        import os

        from conveyor.model.loader import model_directory, read_config, resolve_model_path
        from conveyor.parallel.tp import WorkerSetup, start_group

        world = config.tensor_parallel_size
        # A GGUF is converted here, once, before the ranks load it.
        cfg = read_config(model_directory(resolve_model_path(config.model)))
        num_blocks, num_host = kv_cache_blocks(config, cfg, dtype)
        threads = max(1, (config.torch_threads or os.cpu_count() or 1) // world)
        group = start_group(world, config.device)
        torch.set_num_threads(threads)
        group.broadcast(WorkerSetup(config, str(dtype).removeprefix("torch."), num_blocks, num_host, threads))
        try:
            loaded = load_model(config.model, config.device, dtype, tp=group, tokenizer=config.tokenizer)
            group.broadcast(None)   # every rank has loaded its slice
        except BaseException:
            group.close(timeout=0)
            raise
        return group, loaded

    @staticmethod
    def _tensor_parallel_executor(runner: ModelRunner, group):
        from conveyor.parallel.tp import TPExecutor

        return TPExecutor(runner, group)

    def close(self) -> None:
        """Release what outlives the engine object (the other tensor-parallel ranks)."""
        close = getattr(self.core.executor, "close", None)
        if close is not None:
            close()

    # The core's parts, for tests, benchmarks and stats.
    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def kv(self) -> KVCacheManager:
        return self.core.scheduler.kv

    @property
    def runner(self) -> ModelRunner:
        return self.core.executor

    @property
    def dead(self) -> bool:
        return self.core.dead

    # ---- inputs ----------------------------------------------------------------------------
    def new_request_id(self) -> str:
        self._next_id += 1
        return str(self._next_id - 1)

    def process_inputs(self, prompt: str | list[int] | dict, params: SamplingParams | None = None) -> ProcessedInput:
        """Tokenize and validate a prompt; raises InvalidRequestError (a ValueError) saying why it cannot run."""
        if params is not None and not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params = (params or SamplingParams()).clone()
        params.eos_token_ids = tuple(self.model_config.eos_token_ids)
        text, ids = self._prompt(prompt)
        if params.truncate_prompt_tokens is not None and len(ids) > params.truncate_prompt_tokens:
            text, ids = None, ids[-params.truncate_prompt_tokens:]
        if params.bad_words and params.bad_words_token_ids is None:
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        self.validate(ids, params)
        return ProcessedInput(text, ids, params, cache_salt(prompt))

    def _prompt(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                if text is not None and not isinstance(text, str):
                    raise InvalidRequestError(f"'prompt' must be a string, got {type(text).__name__}")
                return text, token_id_list(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise InvalidRequestError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, token_id_list(prompt)
        raise InvalidRequestError("a prompt must be a string, a list of token ids, or a dict with 'prompt' or "
                                  f"'prompt_token_ids'; got {type(prompt).__name__}")

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError with a clear message if the request can never run."""
        validate_request(prompt_token_ids, params, self.model_config.vocab_size, self.max_model_len, self.grammars)

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int] | dict | ProcessedInput, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, arrival_time: float | None = None) -> str:
        """Queue a request; raises InvalidRequestError (nothing is queued) if it cannot run."""
        inp = prompt if isinstance(prompt, ProcessedInput) else self.process_inputs(prompt, params)
        if not (isinstance(priority, numbers.Integral) and not isinstance(priority, bool)):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
        request_id = request_id if request_id is not None else self.new_request_id()
        if request_id in self.output_processor:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        p = inp.params
        arrival = arrival_time if arrival_time is not None else self.core.clock()
        seqs, leader = [], None
        for i in range(p.num_seqs):
            seed = p.seed + i if p.seed is not None else self._rng.getrandbits(63)
            self._next_seq += 1
            seq = Request(f"seq-{self._next_seq}", inp.prompt_token_ids, p, seed=seed, priority=int(priority),
                          arrival_time=arrival, max_model_len=self.max_model_len, prefill_leader=leader,
                          cache_salt=inp.cache_salt)
            if p.structured_outputs is not None:
                try:
                    seq.grammar = self.grammars.matcher(p.structured_outputs)   # compiled once, cached
                except ValueError as e:
                    raise InvalidRequestError(str(e)) from e
            leader = leader or seq
            seqs.append(seq)
        added = []
        try:
            for seq in seqs:
                self.core.add_request(seq)
                added.append(seq.request_id)
        except BaseException:
            self.core.abort_requests(added)
            raise
        self.output_processor.add(request_id, inp.prompt, inp.prompt_token_ids, p,
                                  [(s.request_id, s.metrics) for s in seqs])
        return request_id

    def abort_request(self, request_id: str, report: bool = True) -> None:
        """Abort now; its KV blocks are free for the next step. report=False: no final output."""
        self.core.abort_requests(self.output_processor.abort(request_id, report))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished()

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration; an output for every request that progressed, finished or failed."""
        t0 = time.perf_counter()
        updates = self.core.step() if self.core.has_unfinished() else []
        outputs, commands = self.output_processor.process(updates)
        for c in commands:
            self.core.finish_request(c.seq_id, c.status, c.reason)
        self.last_step_time = time.perf_counter() - t0
        return outputs

    def save_trace(self) -> None:
        """Write the step trace (config.step_trace) and its Chrome version beside it."""
        tracer, path = self.core.tracer, self.config.step_trace
        if tracer is None or not path:
            return
        tracer.save(path)
        tracer.save_chrome(chrome_path(path))

    def stats(self) -> dict:
        d = self.core.stats_dict()
        d["last_step_time"] = self.last_step_time
        return d


def kv_cache_blocks(config: EngineConfig, cfg, dtype: torch.dtype) -> tuple[int, int]:
    """(device blocks, host swap blocks) of the whole cache; tensor-parallel ranks each hold their
    heads' slice of every block, so the count does not depend on tensor_parallel_size."""
    block_bytes = KVCacheTensors.bytes_per_block(cfg, config.block_size, dtype.itemsize)
    num_blocks = config.num_kv_blocks or max(1, int(config.kv_cache_gib * GIB // block_bytes))
    return num_blocks, int(config.swap_space_gib * GIB // block_bytes)


def cache_salt(prompt: object) -> str | None:
    """A dict prompt's "cache_salt" (vLLM's): a non-empty string, or None when not given."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidRequestError(f"cache_salt must be a non-empty string, got {salt!r}")
    return salt


def grammar_backend(tokenizer, vocab_size: int):
    """The structured-output compiler for this tokenizer (llguidance loads on first use)."""
    from conveyor.sampling.structured import GrammarBackend

    return GrammarBackend(tokenizer.backend.to_str(), list(tokenizer.eos_token_ids), vocab_size)


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word as the tokens it is generated as: alone, and after a space (as vLLM does)."""
    out = []
    for word in words:
        for variant in (word, " " + word.lstrip()):
            ids = tokenizer.encode(variant, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


def validate_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                     grammars=None) -> None:
    """InvalidRequestError with a clear message if the request can never run on this engine."""
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("the prompt is empty")
    if any(not 0 <= t < vocab_size for t in prompt_token_ids):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})")
    if n >= max_model_len:
        raise InvalidRequestError(
            f"the prompt has {n} tokens, {n - max_model_len + 1} more than the context of "
            f"{max_model_len} tokens allows (prompt + at least one generated token; the limit is the "
            f"smaller of the model's context and the KV cache)")
    for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
        if any(not 0 <= t < vocab_size for t in ids):
            raise InvalidRequestError(f"{name} token ids must be in [0, {vocab_size})")
    if params.stop:
        compile_stops(tuple(params.stop))   # built here (the caller's thread), cached for the engine's
    if params.structured_outputs is not None and grammars is not None:
        try:
            grammars.compile(params.structured_outputs)   # the caller's thread; cached for the engine
        except ValueError as e:
            raise InvalidRequestError(str(e)) from e


def chrome_path(path: str) -> str:
    """trace.json -> trace.chrome.json."""
    p = Path(path)
    return str(p.with_name(p.stem + ".chrome" + (p.suffix or ".json")))


def load_cost_model(spec: str | None, model_name: str, dtype: str) -> StepCostModel | None:
    """The profile the auto preemption mode takes its costs from (None: the config's constants)."""
    if spec in (None, "", "none"):
        return None
    path = profile_path(model_name, dtype) if spec == "auto" else Path(spec)
    if spec == "auto" and not path.is_file():
        return None
    model = StepCostModel.load(path)
    logger.info("preemption costs from the profile %s", path)
    return model


def token_id_list(ids: object) -> list[int]:
    """A list of int token ids, or InvalidRequestError (no bools, no floats: 3.0 is not a token id)."""
    if not isinstance(ids, (list, tuple)):
        raise InvalidRequestError(f"prompt_token_ids must be a list of integers, got {type(ids).__name__}")
    out = []
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise InvalidRequestError(f"prompt_token_ids must be a list of integers, got an element {t!r}")
        out.append(int(t))
    return out
