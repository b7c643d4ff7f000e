"""The step loop: schedule -> execute -> update, plus detokenization and stop strings."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from conveyor.engine.outputs import CompletionOutput, RequestOutput
from conveyor.kv.manager import KVCacheManager
from conveyor.model.loader import LoadedModel, load_model
from conveyor.request import Request, RequestStatus
from conveyor.runner.kv_cache import KVCacheTensors
from conveyor.runner.model_runner import ModelRunner
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler.config import SchedulerConfig
from conveyor.scheduler.scheduler import Scheduler
from conveyor.tokenizer import IncrementalDetokenizer, find_stop_string, safe_prefix_len

GIB = 1 << 30


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None               # HF directory or .gguf; None = the demo model
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_kv_blocks: int | None = None       # overrides kv_cache_gib
    kv_cache_gib: float = 1.0
    swap_space_gib: float = 0.5
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


class InvalidRequestError(ValueError):
    """The request cannot run here (too long, bad parameters); the message says why."""


@dataclass(slots=True)
class _Group:
    """A user request: n sibling sequences sharing one prompt."""

    request_id: str
    children: list[Request]
    error: str | None = None
    reported: bool = False


@dataclass(slots=True)
class _SeqOutput:
    detok: IncrementalDetokenizer
    text: str = ""        # visible text (stop string cut off)
    sent_text: int = 0
    sent_tokens: int = 0


class Engine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None):
        self.config = config = config or EngineConfig()
        dtype = getattr(torch, config.dtype)
        self.loaded = loaded or load_model(config.model, config.device, dtype)
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.model_name = self.loaded.name
        self.max_model_len = min(config.max_model_len or 1 << 62, self.model_config.max_position_embeddings)
        block_bytes = KVCacheTensors.bytes_per_block(self.model_config, config.block_size, dtype.itemsize)
        num_blocks = config.num_kv_blocks or max(1, int(config.kv_cache_gib * GIB // block_bytes))
        num_host = int(config.swap_space_gib * GIB // block_bytes)
        self.kv = KVCacheManager(num_blocks, config.block_size, num_host, config.enable_prefix_caching)
        # A sequence can never outgrow the whole cache: cap its length there so that a lone
        # request always fits (else it would preempt itself forever).
        self.max_model_len = min(self.max_model_len, num_blocks * config.block_size)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.runner = ModelRunner(self.loaded.model, num_blocks, config.block_size, num_host, config.device, dtype)
        self._rng = random.Random(config.seed)
        self._groups: dict[str, _Group] = {}
        self._to_report: set[str] = set()   # groups that finished outside a step's token flow
        self._next_id = 0
        self.last_step_time = 0.0

    # ---- requests ------------------------------------------------------------------------
    def new_request_id(self) -> str:
        self._next_id += 1
        return str(self._next_id - 1)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError with a clear message if the request can never run."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {n} tokens, {n - self.max_model_len + 1} more than the context of "
                f"{self.max_model_len} tokens allows (prompt + at least one generated token; the limit is the "
                f"smaller of the model's context and the KV cache)")
        need = self.kv.blocks_for(n + 1)
        if need > self.kv.num_blocks:
            raise InvalidRequestError(
                f"the prompt needs {need} KV blocks but the whole KV cache has {self.kv.num_blocks}")

    def add_request(self, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, arrival_time: float | None = None) -> str:
        """Queue a request. Invalid ones are not raised: they finish with an error output."""
        params = (params or SamplingParams()).clone()
        params.eos_token_ids = tuple(self.model_config.eos_token_ids)
        text, ids = self._prompt(prompt)
        request_id = request_id if request_id is not None else self.new_request_id()
        if request_id in self._groups:
            raise ValueError(f"duplicate request id {request_id!r}")
        group = _Group(request_id, [])
        self._groups[request_id] = group
        try:
            self.validate(ids, params)
        except InvalidRequestError as e:
            group.error = str(e)
            self._to_report.add(request_id)
            return request_id
        leader = None
        for i in range(params.n):
            seed = params.seed + i if params.seed is not None else self._rng.getrandbits(63)
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(rid, ids, params, seed=seed, priority=priority, prompt=text,
                          arrival_time=arrival_time or time.monotonic(), max_model_len=self.max_model_len,
                          prefill_leader=leader)
            req.output = _SeqOutput(IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens))
            leader = leader or req
            group.children.append(req)
            self.scheduler.add_request(req)
        return request_id

    def _prompt(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def abort_request(self, request_id: str) -> None:
        group = self._groups.get(request_id)
        if group is None:
            return
        for req in group.children:
            self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
        self._to_report.add(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration; returns an output for every request that progressed or finished."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        touched = []
        if not out.is_empty:
            model_out = self.runner.execute(out)
            touched = self.scheduler.update(out, model_out)
        for req in touched:
            self._detokenize(req)
        self.last_step_time = time.perf_counter() - t0
        changed = {self._group_id(r.request_id) for r in touched} | self._to_report
        self._to_report = set()
        return self._outputs(changed)

    def _group_id(self, rid: str) -> str:
        return rid.rpartition("#")[0] if "#" in rid and rid.rpartition("#")[0] in self._groups else rid

    def _detokenize(self, req: Request) -> None:
        st: _SeqOutput = req.output
        new = st.detok.add(req.all_token_ids[-1:])
        if req.is_finished:
            new += st.detok.flush()
        st.text += new
        stop = req.params.stop
        if stop and new and not (req.is_finished and req.stop_reason is not None):
            idx = find_stop_string(st.text, len(new), stop)
            if idx is not None:
                hit = next(s for s in stop if st.text.startswith(s, idx))
                st.text = st.text[:idx + len(hit)] if req.params.include_stop_str_in_output else st.text[:idx]
                if req.is_finished:   # finished by length/eos in the same token: the stop string wins
                    req.finish_reason, req.stop_reason = "stop", hit
                else:
                    self.scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED, hit)

    def _outputs(self, changed: set[str]) -> list[RequestOutput]:
        outputs = []
        for gid in changed:
            group = self._groups.get(gid)
            if group is None:
                continue
            finished = group.error is not None or all(c.is_finished for c in group.children)
            outputs.append(self._make_output(group, finished))
            if finished:
                del self._groups[gid]
        return outputs

    def _make_output(self, group: _Group, finished: bool) -> RequestOutput:
        if group.error is not None:
            return RequestOutput(group.request_id, None, [], [CompletionOutput(0, "", [], None, "error", group.error)],
                                 True, error=group.error)
        completions = []
        for i, req in enumerate(group.children):
            st: _SeqOutput = req.output
            toks = req.output_token_ids
            # While running, hold back a tail that may still grow into a stop string.
            shown = len(st.text) if req.is_finished or not req.params.stop else safe_prefix_len(st.text, req.params.stop)
            shown = max(shown, st.sent_text)
            completions.append(CompletionOutput(
                i, st.text[:shown], toks, req.output_logprobs if req.params.logprobs is not None else None,
                req.finish_reason, req.stop_reason, st.text[st.sent_text:shown], toks[st.sent_tokens:]))
            st.sent_text, st.sent_tokens = shown, len(toks)
        first = group.children[0]
        return RequestOutput(group.request_id, first.prompt, first.prompt_token_ids, completions, finished,
                             [c.metrics for c in group.children])

    def stats(self) -> dict:
        d = self.scheduler.stats_dict()
        d["last_step_time"] = self.last_step_time
        return d
