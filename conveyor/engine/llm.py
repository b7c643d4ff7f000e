"""Offline batch API, shaped like vLLM's ``LLM``."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import jinja2
from tqdm import tqdm

from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine, InvalidRequestError, ProcessedRequest
from conveyor.frontend.outputs import RequestOutput
from conveyor.lora.request import LoRARequest
from conveyor.core.stats import EngineStats
from conveyor.sampling.params import SamplingParams

# A dict: {"prompt": text} or {"prompt_token_ids": ids} (with an optional "prompt" text), and
# optionally "cache_salt" (a non-empty string: prefix-cache blocks are shared only within a salt).
PromptType = str | list[int] | dict[str, Any]


_PROMPT_TYPES = ("a prompt is a string, a list of token ids, or a dict with 'prompt' (text) or "
                 "'prompt_token_ids'; give one prompt or a list of them")


def prompt_list(prompts: object) -> list:
    """`prompts` as a list of single prompts (each checked later by the InputProcessor), or
    InvalidRequestError naming the accepted types."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and _is_int(prompts[0])):
        return [prompts]
    if isinstance(prompts, Iterable) and not isinstance(prompts, (bytes, bytearray, set, frozenset)):
        return list(prompts)   # a list, a tuple, a generator (a set has no order to answer in)
    raise InvalidRequestError(f"{_PROMPT_TYPES}; got {type(prompts).__name__}", "prompt")


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def conversation_list(messages: object) -> list[list[dict]]:
    """One conversation (a list of message dicts) or a list of them, or InvalidRequestError."""
    if isinstance(messages, list) and messages and all(_is_message(m) for m in messages):
        return [messages]
    if isinstance(messages, list) and messages and all(
            isinstance(c, list) and c and all(_is_message(m) for m in c) for c in messages):
        return messages
    raise InvalidRequestError("messages must be a conversation (a non-empty list of message dicts, each with a "
                              f"'role') or a list of conversations; got {_describe(messages)}", "messages")


def _is_message(m: object) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str)


def _describe(x: object) -> str:
    if isinstance(x, list):
        return "an empty list" if not x else f"a list starting with {type(x[0]).__name__}"
    return type(x).__name__


def _per_prompt(value, cls: type, n: int, name: str, plural: str, param: str | None = None) -> list:
    """`value` for every prompt (one `cls`, or None), or a list or tuple of them, one per prompt: as a list of n."""
    if value is None or isinstance(value, cls):
        return [value] * n
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise InvalidRequestError(f"got {len(value)} {plural} for {n} prompts", param)
        return list(value)
    raise InvalidRequestError(f"{name} must be a {cls.__name__}, a list of them (one per prompt) or None; "
                              f"got {type(value).__name__}", param)


class LLM:
    """``LLM(model, **options)``: options are EngineConfig's and SchedulerConfig's fields by name
    (``max_num_seqs``, ``block_size``, ``preemption_mode``, ...); or ``config=EngineConfig(...)``; or
    ``engine=`` an Engine built elsewhere (e.g. around a model already in memory)."""

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, engine: Engine | None = None,
                 **options: Any):
        if (config is not None) + (engine is not None) + (model is not None or bool(options)) > 1:
            raise TypeError("give one of: a model and options, config=, engine=")
        self.engine = engine or Engine(config or EngineConfig.from_options(model=model, **options))

    @classmethod
    def from_engine(cls, engine: Engine) -> LLM:
        return cls(engine=engine)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` / ``chat`` use when given no SamplingParams: the model's defaults
        (``generation_config`` / ``override_generation_config``; conveyor/sampling/defaults.py)."""
        return SamplingParams(**self.engine.generation_defaults)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        Every prompt is checked before any is queued (ValueError naming the prompt); if the
        call fails or is interrupted, none of its requests stays queued. `lora_request`: the LoRA
        adapter all prompts run under, or one per prompt (None: the base model); needs
        ``enable_lora``.
        """
        inputs = self._inputs(prompts, sampling_params, priority, lora_request)
        ids: list[str] = []
        try:
            for inp, prio in inputs:
                ids.append(self.engine.add_request(inp, priority=prio))
            return self._run(ids, use_tqdm if use_tqdm is not None else len(ids) >= 8)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid, report=False)
            raise

    def _inputs(self, prompts, sampling_params, priority, lora_request=None) -> list[tuple[ProcessedRequest, int]]:
        prompts = prompt_list(prompts)
        loras = self._loras(lora_request, len(prompts))
        params = _per_prompt(sampling_params, SamplingParams, len(prompts), "sampling_params", "sampling params")
        if priority is None:
            priority = [0] * len(prompts)
        elif isinstance(priority, (str, bytes)) or not isinstance(priority, Sequence):
            raise InvalidRequestError("priority must be a list of integers, one per prompt; got "
                                      f"{type(priority).__name__}", "priority")
        elif len(priority) != len(prompts):
            raise InvalidRequestError(f"got {len(priority)} priorities for {len(prompts)} prompts", "priority")
        elif not all(_is_int(p) for p in priority):
            raise InvalidRequestError(f"priority must be a list of integers, got {list(priority)!r}", "priority")
        inputs = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            try:
                processed = self.engine.inputs.process(prompt, sp)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"prompt {i}: {e}", e.param, e.code) from None
            if loras[i] is not None:
                processed = dataclasses.replace(processed, lora=loras[i])
            inputs.append((processed, int(priority[i])))
        return inputs

    def _loras(self, lora_request, n: int) -> list[LoRARequest | None]:
        loras = _per_prompt(lora_request, LoRARequest, n, "lora_request", "LoRA requests", "lora_request")
        if not all(x is None or isinstance(x, LoRARequest) for x in loras):
            raise InvalidRequestError("lora_request must hold LoRARequest objects (or None)", "lora_request")
        if any(x is not None for x in loras) and not self.engine.config.enable_lora:
            raise InvalidRequestError("LoRA adapters are off: build the LLM with enable_lora=True", "lora_request")
        return loras

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | None = None, add_generation_prompt: bool = True) -> list[RequestOutput]:
        tok = self.engine.tokenizer
        prompts = []
        for i, conversation in enumerate(conversation_list(messages)):
            try:
                text = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
            except (jinja2.TemplateError, TypeError, AttributeError) as e:   # the template met data it cannot render
                raise InvalidRequestError(f"conversation {i}: the chat template cannot render it ({e})",
                                          "messages") from e
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", unit="req", dynamic_ncols=True) if use_tqdm else None
        generated = 0
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    generated += sum(len(c.delta_token_ids) for c in out.outputs)
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                if bar is not None:
                    bar.set_postfix_str(f"{generated / max(bar.format_dict['elapsed'], 1e-9):.1f} tok/s", refresh=False)
        finally:
            if bar is not None:
                bar.close()
            self.engine.save_trace()
        return [done[i] for i in ids if i in done]

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling: str = "mean",
              use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Embeddings of the prompts (``output.embedding``, L2-normalised), batched through the engine
        like generation: the final hidden states pooled by "mean" over the prompt or its "last" token."""
        if pooling not in ("mean", "last"):
            raise ValueError(f"pooling must be mean or last, got {pooling!r}")
        return self.generate(prompts, SamplingParams(max_tokens=1, pooling=pooling), use_tqdm=use_tqdm)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (they also stop when this process exits)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> EngineStats:
        return self.engine.stats()
