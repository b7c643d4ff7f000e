"""The engine: front end (inputs, outputs) + the engine core with the model.

``EngineBackend`` is what the engine core's process needs: the model, the ``EngineCore`` with the
``ModelRunner`` as its executor, and the structured-output matchers. It takes validated
``EngineRequest``s and returns each step's per-sequence deltas (``SeqUpdate``) -- nothing about
text. ``Engine`` adds the ``FrontEnd`` (input validation, detokenization, stop strings, ``n``
siblings) in the same process, for ``LLM`` and the in-process ``AsyncEngine``; ``ProcessEngine``
keeps the front end in the server's process and runs an ``EngineBackend`` in a child.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch

from conveyor.config import EngineConfig
from conveyor.core.engine_core import EngineCore, EngineDeadError, SeqUpdate, metrics_snapshot
from conveyor.frontend.front_end import FrontEnd
from conveyor.frontend.inputs import (InputProcessor, InvalidRequestError, ProcessedRequest,  # noqa: F401 - re-exported
                                    grammar_backend)
from conveyor.frontend.outputs import RequestOutput
from conveyor.core.stats import EngineStats
from conveyor.core.trace import StepTracer
from conveyor.core.wire import EngineRequest, Finish
from conveyor.kv.layout import KVLayout
from conveyor.kv.manager import KVCacheManager
from conveyor.lora.peft_config import LoRAAdapterError, read_peft_config
from conveyor.lora.request import LoRARequest
from conveyor.model.dtype import resolve_dtype
from conveyor.kv.events import KVEventRecorder, ZmqEventPublisher
from conveyor.model.cpu_kernels import kernels_digest
from conveyor.model.loader import (DEMO_NAME, LoadedModel, default_model_name, load_model, model_directory,
                                   read_config, resolve_model_path, weight_bytes_estimate)
from conveyor.parallel.tp import TPExecutor, WorkerSetup, start_group
from conveyor.paths import profile_path
from conveyor.request import Request
from conveyor.runner.kv_cache import KVCacheTensors
from conveyor.runner.model_runner import ModelRunner
from conveyor.sampling.defaults import describe as describe_defaults, generation_defaults
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler.costs import StepCostModel, preemption_costs
from conveyor.scheduler.fairness import TokenWeights
from conveyor.scheduler.scheduler import Scheduler
from conveyor.spec.speculator import SpeculativeConfig, Speculator

__all__ = ["Engine", "EngineBackend", "EngineConfig", "EngineDeadError", "InvalidRequestError", "ProcessedRequest"]

GIB = 1 << 30
logger = logging.getLogger(__name__)


class EngineBackend:
    """The model and the engine core; requests in as EngineRequests, deltas out (module docstring)."""

    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None):
        self.config = config = config or EngineConfig()
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        if loaded is not None:   # a model already in memory runs in its own dtype
            dtype = loaded.model.dtype
        else:
            dtype = getattr(torch, resolve_dtype(config.dtype, config.device))
            if dtype == torch.float16 and torch.device(config.device).type == "cpu":
                raise ValueError("dtype float16 runs on CUDA only; on a CPU use bfloat16 or float32 (or auto)")
        self.dtype = str(dtype).removeprefix("torch.")
        # The model's default sampling parameters, checked before the (slow) load.
        path = loaded.path if loaded is not None else resolve_model_path(config.model)
        name = loaded.name if loaded is not None else default_model_name(path)
        self.generation_defaults, source = generation_defaults(
            config.generation_config, path, name == DEMO_NAME, config.override_generation_config)
        logger.info(describe_defaults(self.generation_defaults, source))
        tp = None
        if loaded is None and config.tensor_parallel_size == 1 and torch.device(config.device).type == "cpu":
            check_memory(config, path, dtype)
        if config.tensor_parallel_size > 1:
            if config.enable_lora:
                raise ValueError("enable_lora is not supported with tensor_parallel_size > 1 (LoRA deltas are "
                                 "computed on whole projections, not on a rank's slice)")
            if loaded is not None:
                raise ValueError("tensor parallelism loads its slices itself: pass a model path, not a loaded model")
            tp, loaded = self._start_tensor_parallel(config, dtype)
        self.loaded = loaded or load_model(config.model, config.device, dtype, tokenizer=config.tokenizer,
                                           quantization=config.quantization)
        self.model_config = self.loaded.config
        if config.enable_lora and self.model_config.is_moe:
            raise ValueError("enable_lora is not supported with mixture-of-experts models (adapters of the "
                             "routed experts are not applied)")
        self.tokenizer = self.loaded.tokenizer
        self.model_name = self.loaded.name
        # Layer groups with their own block tables when some layers attend to a window only.
        self.kv_layout = layout = KVLayout.from_config(self.model_config, config.hybrid_kv_cache)
        num_blocks, num_host = kv_cache_blocks(config, self.model_config, dtype, layout)
        # What /metrics reports as resident (rank 0's share under tensor parallelism for weights).
        self.weight_bytes = sum(self.loaded.model.weight_bytes().values())
        self.kv_cache_bytes = num_blocks * KVCacheTensors.bytes_per_block(self.model_config, config.block_size,
                                                                          dtype.itemsize, layout)
        kv = KVCacheManager(num_blocks, config.block_size, num_host, config.enable_prefix_caching, layout)
        # A sequence can never outgrow the whole cache: cap its length there so that a lone
        # request always fits (else it would preempt itself forever).
        self.max_model_len = min(config.max_model_len or 1 << 62, self.model_config.max_position_embeddings,
                                 kv.max_tokens)
        runner = ModelRunner(self.loaded.model, num_blocks, config.block_size, num_host, config.device, dtype,
                             layout=layout, enable_lora=config.enable_lora, max_loras=config.max_loras,
                             max_lora_rank=config.max_lora_rank)
        if tp is not None:
            runner = self._tensor_parallel_executor(runner, tp)
        self.cost_model = load_cost_model(config.cost_model, self.model_name, self.dtype, torch.get_num_threads())
        warn_if_profile_stale(self.cost_model, self.loaded.model)
        costs = preemption_costs(config.scheduler, self.cost_model)   # user-set costs win over the profile
        self.core = EngineCore(Scheduler(config.scheduler, kv, costs=costs,
                                         token_weights=TokenWeights.of(self.cost_model)), runner,
                               time.monotonic, config.max_consecutive_step_failures)
        self.core.scheduler.max_loras = config.max_loras if config.enable_lora else 0
        self._checked_loras: dict[int, LoRARequest] = {}
        spec = SpeculativeConfig.parse(config.speculative_config)
        if spec is not None:
            self.core.scheduler.speculator = Speculator(spec, self.cost_model)
        if config.step_trace:
            self.core.tracer = StepTracer(meta={"source": "engine", "model": self.model_name,
                                                "config": asdict(config)})
        self.grammars = grammar_backend(self.tokenizer, self.model_config.vocab_size)
        self.core.grammars = self.grammars
        self.last_step_time = 0.0   # seconds in the latest step()
        self.kv_events = kv_event_publisher(config, kv)   # None unless config.kv_events_endpoint

    @staticmethod
    def _start_tensor_parallel(config: EngineConfig, dtype: torch.dtype):
        """Start the group, tell the other ranks what to load, load rank 0's slice."""
        world = config.tensor_parallel_size
        # A GGUF is converted here, once, before the ranks load it.
        cfg = read_config(model_directory(resolve_model_path(config.model)))
        if cfg.is_moe:
            raise ValueError("tensor_parallel_size > 1 does not split mixture-of-experts models yet")
        num_blocks, num_host = kv_cache_blocks(config, cfg, dtype, KVLayout.from_config(cfg, config.hybrid_kv_cache))
        if config.distributed_executor_backend == "ray":   # each rank has its own bundle of CPUs
            threads = max(1, config.torch_threads or 1)
        else:
            threads = max(1, (config.torch_threads or os.cpu_count() or 1) // world)
        group = start_group(world, config.device, config.distributed_executor_backend, threads)
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
        return TPExecutor(runner, group)

    def close(self) -> None:
        """Release what outlives the engine object (the other tensor-parallel ranks)."""
        if self.kv_events is not None:
            self.kv_events.publish(self.kv.events.take())
            self.kv_events.close()
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
    # ---- requests (validated by a front end) --------------------------------------------------
    def add(self, req: EngineRequest) -> None:
        """Queue a request's sequences (all or none); it was validated by the front end."""
        assert len(req.seq_ids) == len(req.seeds) == req.params.num_seqs, "one seed per sequence"
        if req.lora is not None:
            self._check_lora(req.lora)
        p, seqs, leader = req.params, [], None
        for seq_id, seed in zip(req.seq_ids, req.seeds):
            seq = Request(seq_id, req.prompt_token_ids, p, seed=seed, priority=req.priority,
                          arrival_time=req.arrival_time, max_model_len=self.max_model_len, prefill_leader=leader,
                          cache_salt=req.cache_salt, tenant=req.tenant, lora=req.lora)
            if p.structured_outputs is not None:
                seq.grammar = self.grammars.matcher(p.structured_outputs)   # compiled once, cached
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

    def _check_lora(self, lora: LoRARequest) -> None:
        """Refuse a request whose adapter the runner would refuse (its config; once per adapter id),
        before it can fail a step with others in it."""
        if not self.config.enable_lora:
            raise InvalidRequestError("LoRA adapters are off: start the engine with enable_lora", "model")
        known = self._checked_loras.get(lora.lora_int_id)
        if known is not None and known != lora:
            raise InvalidRequestError(f"LoRA adapter id {lora.lora_int_id} is already {known.lora_name!r} at "
                                      f"{known.lora_path!r}: give {lora.lora_name!r} its own id", "model")
        if known is None:
            try:
                read_peft_config(lora.lora_path, lora.lora_name, self.config.max_lora_rank)
            except LoRAAdapterError as e:
                raise InvalidRequestError(str(e), "model") from None
            self._checked_loras[lora.lora_int_id] = lora

    def finish(self, command: Finish) -> list[SeqUpdate]:
        """End sequences the front end finished (a stop string, a failed sibling) or the caller aborted;
        for a caller's abort (``report``), the deltas that say so, with the final metrics."""
        ended = self.core.abort_requests(command.seq_ids, command.status, command.reason)
        if self.kv_events is not None:
            self.kv_events.publish(self.kv.events.take())
        if not command.report:
            return []
        return [SeqUpdate(r.request_id, None, None, r.finish_reason, None, None, metrics_snapshot(r)) for r in ended]

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def run_step(self) -> list[SeqUpdate]:
        """One iteration of the core; a delta for every sequence that got a token, finished or failed."""
        t0 = time.perf_counter()
        updates = self.core.step() if self.core.has_unfinished() else []
        if self.kv_events is not None:   # one batch per step (none for a step without events)
            self.kv_events.publish(self.kv.events.take())
        self.last_step_time = time.perf_counter() - t0
        return updates

    def save_trace(self) -> None:
        """Write the step trace (config.step_trace) and its Chrome version beside it."""
        tracer, path = self.core.tracer, self.config.step_trace
        if tracer is None or not path:
            return
        tracer.save(path)
        tracer.save_chrome(chrome_path(path))

    def stats(self) -> EngineStats:
        """The core's snapshot, with the latest step's time (Engine.step: output processing included)."""
        return self.core.engine_stats().replace(last_step_time=self.last_step_time, weight_bytes=self.weight_bytes,
                                                kv_cache_bytes=self.kv_cache_bytes)

    def input_processor(self) -> InputProcessor:
        """Validation against this engine's model, for a front end (here or in another process)."""
        return InputProcessor(self.tokenizer, self.model_config.vocab_size, self.max_model_len,
                              self.model_config.eos_token_ids, self.grammars, self.generation_defaults)


class Engine(EngineBackend):
    """The engine core and its front end in one process (``LLM``, the in-process ``AsyncEngine``)."""

    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None):
        super().__init__(config, loaded)
        self.frontend = FrontEnd(self.input_processor(), self.config.seed)

    def new_request_id(self) -> str:
        return self.frontend.new_request_id()

    @property
    def inputs(self) -> InputProcessor:
        """Input processing (tokenization, every check): ``inputs.process(prompt, params)`` -> a ProcessedRequest."""
        return self.frontend.inputs

    def add_request(self, prompt: str | list[int] | dict | ProcessedRequest, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, arrival_time: float | None = None) -> str:
        """Queue a request; raises InvalidRequestError (nothing is queued) if it cannot run."""
        if self.core.dead:
            raise EngineDeadError(self.core.dead_reason)
        arrival = arrival_time if arrival_time is not None else self.core.clock()
        req = self.frontend.register(prompt, params, request_id, priority, arrival)
        try:
            self.add(req)
        except BaseException:
            self.frontend.forget(req.request_id)
            raise
        return req.request_id

    def abort_request(self, request_id: str, report: bool = True) -> None:
        """Abort now; its KV blocks are free for the next step. report=False: no final output."""
        self.core.abort_requests(self.frontend.abort(request_id, report))

    def has_unfinished_requests(self) -> bool:
        return self.frontend.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One iteration; an output for every request that progressed, finished or failed."""
        t0 = time.perf_counter()
        outputs, finishes = self.frontend.process(self.run_step())
        for command in finishes:
            self.finish(command)
        self.last_step_time = time.perf_counter() - t0
        return outputs


def kv_cache_blocks(config: EngineConfig, cfg, dtype: torch.dtype, layout: KVLayout | None = None) -> tuple[int, int]:
    """(device blocks, host swap blocks) of the whole cache; tensor-parallel ranks each hold their
    heads' slice of every block, so the count does not depend on tensor_parallel_size. With layer
    groups (`layout`) a block holds one group's layers."""
    block_bytes = KVCacheTensors.bytes_per_block(cfg, config.block_size, dtype.itemsize, layout)
    num_blocks = config.num_kv_blocks or max(1, int(config.kv_cache_gib * GIB // block_bytes))
    return num_blocks, int(config.swap_space_gib * GIB // block_bytes)






def available_memory() -> int | None:
    """Bytes this process may still take: /proc/meminfo's MemAvailable, capped by a cgroup v2
    limit where one is set (a container's: its limit less what it uses, page cache excepted);
    None where neither is known."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            stat = dict(line.split() for line in Path("/sys/fs/cgroup/memory.stat").read_text().splitlines())
            room = int(limit) - used + int(stat.get("file", 0))   # the page cache it holds can be reclaimed
            avail = room if avail is None else min(avail, room)
    except (OSError, ValueError):
        pass
    return avail


def check_memory(config: EngineConfig, path: Path, dtype: torch.dtype) -> None:
    """Refuse, before loading anything, a model whose weights plus the KV cache and swap space
    asked for cannot fit in the memory available (a clear error instead of the kernel's OOM killer
    mid-load). An estimate from the files' headers (loader.weight_bytes_estimate), no margin:
    only what certainly cannot fit is refused."""
    avail = available_memory()
    if avail is None:
        return
    cfg = read_config(model_directory(path, weights=False))
    layout = KVLayout.from_config(cfg, config.hybrid_kv_cache)
    blocks, host = kv_cache_blocks(config, cfg, dtype, layout)
    per_block = KVCacheTensors.bytes_per_block(cfg, config.block_size, dtype.itemsize, layout)
    weights = weight_bytes_estimate(path, dtype, config.quantization)
    need = weights + (blocks + host) * per_block
    if need > avail:
        gib = 1 << 30
        raise ValueError(
            f"not enough memory for {path.name}: its weights (~{weights / gib:.1f} GiB) + the KV cache "
            f"({blocks * per_block / gib:.2f} GiB) + the swap space ({host * per_block / gib:.2f} GiB) need "
            f"~{need / gib:.1f} GiB and {avail / gib:.1f} GiB are available; lower --kv-cache-gib / "
            "--num-kv-blocks or --swap-space-gib, use a smaller or more quantized file, or free memory")


def kv_event_publisher(config: EngineConfig, kv: KVCacheManager):
    """The KV-event publisher (conveyor/kv/events.py) when config.kv_events_endpoint is set, fed by `kv`."""
    if not config.kv_events_endpoint:
        return None
    if not config.enable_prefix_caching:
        logger.warning("KV events are on but prefix caching is off: no block is ever cached, so none is reported")
    publisher = ZmqEventPublisher(config.kv_events_endpoint, config.kv_events_replay_endpoint,
                                  config.kv_events_topic, config.kv_events_buffer_steps, config.kv_events_hwm,
                                  dp_rank=config.data_parallel_rank)
    kv.enable_events(KVEventRecorder(config.block_size))
    logger.info("KV events on %s (replay: %s, dp_rank %d)", publisher.endpoint, publisher.replay_endpoint,
                config.data_parallel_rank)
    return publisher


def chrome_path(path: str) -> str:
    """trace.json -> trace.chrome.json."""
    p = Path(path)
    return str(p.with_name(p.stem + ".chrome" + (p.suffix or ".json")))


def warn_if_profile_stale(cost: StepCostModel | None, model) -> None:
    """Warn when a saved profile was measured on other kernel paths than this model takes now (its
    ``dispatch_thresholds`` differ: another Conveyor version or CPU rule, e.g. bf16 GGUF matmuls that
    moved to the int8 kernel) or on other C++ kernels (``meta.kernels``, their sources' digest), since
    its step costs then describe another engine; or with another number of torch threads (on the
    2-vCPU Zen4 one thread's steps cost 1.3-1.9x two threads', docs/simulator.md)."""
    thresholds = getattr(model, "dispatch_thresholds", None)
    if cost is None or thresholds is None:
        return
    meta = cost.meta or {}
    threads, now_threads = (meta.get("machine") or {}).get("threads"), torch.get_num_threads()
    if isinstance(threads, int) and threads != now_threads:
        logger.warning("the step-cost profile was measured with %d torch threads, this engine runs %d: its costs "
                       "describe another engine; run `conveyor profile --torch-threads %d` (the engine takes "
                       "that profile for %d threads)", threads, now_threads, now_threads, now_threads)
    digest, now_digest = meta.get("kernels"), kernels_digest()
    if digest is not None and digest != now_digest:
        logger.warning("the step-cost profile was measured with other C++ kernels (sources %s, now %s): its "
                       "costs describe another engine; run `conveyor profile` again", digest, now_digest)
    saved = meta.get("dispatch_thresholds")
    if saved is None:
        return
    now = thresholds()
    try:
        saved = {str(k): int(v) for k, v in saved.items()}
    except (AttributeError, TypeError, ValueError):
        logger.warning("the step-cost profile's kernel switches are unreadable (%r): it may describe other kernels",
                       saved)
        return
    if saved != now:
        logger.warning("the step-cost profile was measured with kernel switches %s, this model has %s: its costs "
                       "describe other kernels; run `conveyor profile` again", saved, now)


def load_cost_model(spec: str | None, model_name: str, dtype: str, threads: int | None = None) -> StepCostModel | None:
    """The profile the auto preemption mode takes its costs from (None: the config's constants). With
    "auto": the one measured with this engine's `threads` torch threads if there is one (`conveyor
    profile --torch-threads N`), else the model's plain one, else none."""
    if spec in (None, "", "none"):
        return None
    path = Path(spec)
    if spec == "auto":
        path = next((p for p in (profile_path(model_name, dtype, threads), profile_path(model_name, dtype))
                     if p.is_file()), None)
        if path is None:
            return None
    model = StepCostModel.load(path)
    logger.info("preemption costs from the profile %s", path)
    return model
