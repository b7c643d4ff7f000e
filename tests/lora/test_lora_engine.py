"""Multi-LoRA through the whole engine (LLM: the scheduler, the KV cache, the runner): every request's
greedy tokens equal transformers + peft for its adapter, with several adapters and the base model in
one batch, under preemption and prefix caching, with fewer adapter slots than adapters (evicted and
read again); a prefix computed under one adapter is never served to another."""

from __future__ import annotations

import pytest
import torch

from conveyor.engine.llm import LLM
from conveyor.errors import InvalidRequestError
from conveyor.lora.request import LoRARequest
from conveyor.sampling.params import SamplingParams
from lora_testlib import with_tokenizer

NEW = 6


def greedy(model: torch.nn.Module, prompt: list[int], n: int = NEW) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (length + i,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def world(worlds):
    w = worlds("llama")
    with_tokenizer(w.root / "base")
    return w


def make_llm(world, **options) -> LLM:
    opts = dict(dtype="float32", enable_lora=True, block_size=4, num_kv_blocks=256, max_num_seqs=8,
                max_num_batched_tokens=64, enable_prefix_caching=True)
    return LLM(str(world.root / "base"), **{**opts, **options})


def run(llm: LLM, ps: list[list[int]], loras: list[LoRARequest | None]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, lora_request=loras)
    return [list(o.outputs[0].token_ids) for o in outs]


def expected(world, ps, loras) -> list[list[int]]:
    return [greedy(world.hf if lora is None else world.peft[lora.lora_name], p) for p, lora in zip(ps, loras)]


def test_adapters_and_the_base_share_a_batch(world):
    llm = make_llm(world)
    names = [None, "attn", "all", "patterned"]
    ps = prompts(8, 9, seed=1)
    loras = [None if names[i % 4] is None else world.loras[names[i % 4]] for i in range(len(ps))]
    assert run(llm, ps, loras) == expected(world, ps, loras)
    stats = llm.engine.stats()
    assert stats.max_lora == 4 and stats.lora_running == () and stats.num_running == 0


def test_preemption_and_a_single_adapter_slot(world):
    """A KV cache too small for the batch (requests are preempted and recomputed or swapped back), and
    one adapter slot for three adapters (the scheduler never runs two at once; each is read again)."""
    small = dict(num_kv_blocks=24, admission_policy="optimistic")
    for options in (dict(small, preemption_mode="recompute", enable_prefix_caching=False),
                    dict(small, preemption_mode="swap", swap_space_gib=0.01),
                    dict(max_loras=1)):
        llm = make_llm(world, **options)
        ps = prompts(6, 14, seed=2)
        loras = [world.loras[n] for n in ("attn", "all", "patterned")] * 2
        assert run(llm, ps, loras) == expected(world, ps, loras), options
        if "num_kv_blocks" in options:
            assert llm.engine.stats().num_preemptions > 0, options


def test_a_prefix_is_never_shared_across_adapters(world):
    llm = make_llm(world)
    p = prompts(1, 20, seed=3)[0]
    a, b = world.loras["attn"], world.loras["all"]
    for lora in (a, b, None):
        hits = llm.engine.stats().prefix_cache_hits
        assert run(llm, [p], [lora]) == expected(world, [p], [lora])
        assert llm.engine.stats().prefix_cache_hits == hits   # a new adapter (or none): nothing to reuse
    assert run(llm, [p], [b]) == expected(world, [p], [b])
    assert llm.engine.stats().prefix_cache_hits > hits   # the same adapter again: its own blocks


def test_lora_refused_clearly(world, tmp_path):
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        run(make_llm(world, enable_lora=False), prompts(1, 5, 4), [world.loras["attn"]])
    llm = make_llm(world, max_lora_rank=4)
    with pytest.raises(InvalidRequestError, match="rank 8 exceeds max_lora_rank 4"):
        run(llm, prompts(1, 5, 4), [world.loras["all"]])
    with pytest.raises(InvalidRequestError, match="not a PEFT adapter"):
        run(llm, prompts(1, 5, 4), [LoRARequest("nothing", 9, str(tmp_path))])
    attn = world.loras["attn"]
    run(llm, prompts(1, 5, 4), [attn])
    with pytest.raises(InvalidRequestError, match="already 'attn'"):   # an id names one adapter
        run(llm, prompts(1, 5, 4), [LoRARequest("other", attn.lora_int_id, world.loras["patterned"].lora_path)])
    ps = prompts(2, 5, 5)   # the engine still serves
    assert run(llm, ps, [world.loras["attn"], None]) == expected(world, ps, [world.loras["attn"], None])
