"""Offline batch API, shaped like vLLM's ``LLM``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from conveyor.engine.engine import Engine, EngineConfig
from conveyor.engine.outputs import RequestOutput
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler.config import SchedulerConfig

PromptType = str | list[int] | dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, *, max_num_seqs: int = 128, max_num_batched_tokens: int = 1024,
                 block_size: int = 16, num_kv_blocks: int | None = None, kv_cache_gib: float = 1.0,
                 swap_space_gib: float = 0.5, preemption_mode: str = "recompute",
                 admission_policy: str = "predictive", enable_prefix_caching: bool = True,
                 scheduling_policy: str = "continuous", seed: int = 0, device: str = "cpu",
                 dtype: str = "float32", max_model_len: int | None = None, **scheduler_kwargs: Any):
        sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                preemption_mode=preemption_mode, admission_policy=admission_policy,
                                scheduling_policy=scheduling_policy, **scheduler_kwargs)
        self.engine = Engine(EngineConfig(
            model=model, device=device, dtype=dtype, block_size=block_size, num_kv_blocks=num_kv_blocks,
            kv_cache_gib=kv_cache_gib, swap_space_gib=swap_space_gib, max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching, seed=seed, scheduler=sched))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        ids = [self.engine.add_request(p, sp, priority=priority[i] if priority else 0)
               for i, (p, sp) in enumerate(zip(prompts, params))]
        return self._run(ids, use_tqdm if use_tqdm is not None else len(prompts) >= 8)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | None = None, add_generation_prompt: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [{"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}
                   for text in (tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt)
                                for c in conversations)]
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
        return [done[i] for i in ids if i in done]

    def stats(self) -> dict:
        return self.engine.stats()
