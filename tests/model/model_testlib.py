"""Helpers for the model tests: tiny random HF checkpoints, greedy runs through the engine core.

Imported by the test files of tests/model (pytest puts this directory on sys.path because
tests/model has no __init__.py).
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers import Gemma3ForCausalLM, Gemma3TextConfig
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from conveyor.core.engine_core import EngineCore
from conveyor.kv.manager import KVCacheManager
from conveyor.model.config import ModelConfig
from conveyor.model.llama import LlamaForCausalLM as ConveyorModel
from conveyor.model.loader import build_model, load_weights, read_config
from conveyor.runner.inputs import SeqWork, build_inputs
from conveyor.request import Request
from conveyor.runner.kv_cache import KVCacheTensors
from conveyor.runner.model_runner import ModelRunner
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler.config import SchedulerConfig
from conveyor.scheduler.output import ModelOutput, SchedulerOutput
from conveyor.scheduler.scheduler import Scheduler

VOCAB = 256
MAX_POS = 512
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               max_position_embeddings=MAX_POS, rms_norm_eps=1e-6, tie_word_embeddings=False,
               bos_token_id=None, eos_token_id=None, pad_token_id=None)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}

# name -> (config class, model class, extra config kwargs)
FAMILIES: dict[str, tuple[type, type, dict]] = {
    "llama_gqa": (LlamaConfig, LlamaForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama3_rope": (LlamaConfig, LlamaForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=2, rope_theta=50000.0, rope_scaling=dict(LLAMA3_SCALING))),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2,
                                                  rope_theta=1000000.0)),
    # head_dim 24 != 64 / 4: q_size (96) differs from hidden_size.
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24)),
    # sliding_window (4096 by default) exceeds every context used here, so it has no effect.
    "mistral": (MistralConfig, MistralForCausalLM, dict(num_attention_heads=4, num_key_value_heads=1)),
    # Mistral v0.1's sliding window on every layer (8 tokens, far below the prompts).
    "mistral_swa": (MistralConfig, MistralForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2,
                                                            sliding_window=8)),
    "llama_tied": (LlamaConfig, LlamaForCausalLM, dict(num_attention_heads=4, num_key_value_heads=4,
                                                       tie_word_embeddings=True)),
    # Gemma 3: sliding-window layers (window 8, far below the prompts) around a global one, each
    # kind with its RoPE base (the global one scaled), GeGLU, four norms per layer, q/k norms, a
    # scaled embedding and a query scale that is not 1/sqrt(head_dim).
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        query_pre_attn_scalar=24, sliding_window=8, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
}


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Weights with O(1) activations and well-separated logits (HF's init gives near-uniform
    logits, unit norms and zero biases, which would hide norm/bias bugs and make argmax ties)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():   # tied weights are listed once
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)            # U(0.5, 1.5)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1]
                scale = 3.0 if "lm_head" in name else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * scale / math.sqrt(fan_in))
        if model.config.tie_word_embeddings:
            # With tied weights the input embedding dominates the residual stream and the model
            # would just repeat its last token; a final norm with random signs breaks e_x . e_x.
            w = model.model.norm.weight
            w.copy_(torch.randn(w.shape, generator=g))


# Shapes that reach the attention kernels' register-blocked paths (head_dim 64 and 128; the families
# above take the portable one), one KV head: for the kernel tests only, not every family's test.
KERNEL_FAMILIES: dict[str, tuple[type, type, dict]] = {
    "mqa_hd64": (LlamaConfig, LlamaForCausalLM, dict(num_attention_heads=4, num_key_value_heads=1, head_dim=64)),
    "mqa_hd128": (LlamaConfig, LlamaForCausalLM, dict(num_attention_heads=4, num_key_value_heads=1, head_dim=128)),
}


# Mixture-of-experts models (tests/model/test_moe.py): 8 experts, top-2. The Qwen3-MoE has a dense
# MLP layer between two routed ones (mlp_only_layers) and keeps its top-k weights as the softmax
# gave them (norm_topk_prob False, the config's default); Mixtral renormalizes them.
MOE_FAMILIES: dict[str, tuple[type, type, dict]] = {
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=False)),
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=32, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=None)),
    # Rows of 256 columns everywhere, for K-quant files (super-blocks of 256).
    "qwen3_moe_256": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True)),
}


def make_hf_model(family: str, seed: int = 0):
    cfg_cls, model_cls, extra = {**FAMILIES, **KERNEL_FAMILIES, **MOE_FAMILIES}[family]
    torch.manual_seed(seed)
    hf_cfg = cfg_cls(**{**_COMMON, **extra})
    model = model_cls(hf_cfg).float().eval()
    randomize_(model, seed)
    return model


@dataclass
class TinyFamily:
    name: str
    path: Path
    hf: torch.nn.Module
    cfg: ModelConfig
    model: ConveyorModel
    _hf_cache: dict = field(default_factory=dict)

    def hf_greedy(self, prompt: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:
        """transformers' generate(do_sample=False): new token ids and the logits of each step."""
        key = (tuple(prompt), max_new)
        if key not in self._hf_cache:
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                out = self.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                       do_sample=False, output_logits=True, return_dict_in_generate=True)
            assert out.sequences.shape[1] == len(prompt) + max_new   # no EOS configured: never stops early
            self._hf_cache[key] = (out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits, 0).float())
        return self._hf_cache[key]


def load_family(family: str, directory: Path, seed: int = 0) -> TinyFamily:
    hf = make_hf_model(family, seed)
    hf.save_pretrained(directory)   # safetensors is the only format transformers 5 writes
    cfg = read_config(directory)
    return TinyFamily(family, directory, hf, cfg, build_model(cfg, load_weights(directory)))


def with_tokenizer(directory: Path) -> str:
    """The Engine loads a tokenizer with the model: give a tiny checkpoint the demo's."""
    import shutil

    from conveyor.model.loader import demo_model_path, model_directory

    for f in model_directory(demo_model_path()).glob("tokenizer*"):
        if not (directory / f.name).exists():
            shutil.copy(f, directory / f.name)
    return str(directory)


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


# ---------------------------------------------------------------------------------------------
# Greedy generation through EngineCore (the engine's step loop), and prompt logits.


def allocate_tables(needs: list[int], block_size: int, seed: int, spare: int = 3) -> tuple[list[list[int]], int]:
    """Distinct, shuffled (non-contiguous) block ids per sequence from a pool with spare blocks."""
    total = sum(-(-n // block_size) for n in needs) + spare
    ids = list(range(total))
    random.Random(seed).shuffle(ids)
    tables, at = [], 0
    for n in needs:
        k = -(-n // block_size)
        tables.append(ids[at:at + k])
        at += k
    return tables, total


@dataclass
class GreedyResult:
    tokens: list[list[int]]
    logits: list[torch.Tensor]   # per sequence [max_new, vocab]: the row each token was sampled from
    num_steps: int
    mixed_steps: int             # steps that held both a prompt chunk and a decode


class _LogitsRecorder:
    """The ModelRunner as the core's executor, keeping each sampled row's logits by request id."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        runner.record_logits = True
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.mixed_steps = 0

    def swap(self, swap_out, swap_in) -> None:
        self.runner.swap(swap_out, swap_in)

    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        out = self.runner.execute(plan)
        for rid, row in self.runner.last_logits.items():
            self.logits.setdefault(rid, []).append(row.clone())
        self.mixed_steps += plan.num_prefill_tokens > 0 and plan.num_decode_tokens > 0
        return out


def conveyor_greedy(model: ConveyorModel, prompts: list[list[int]], max_new: int, *, block_size: int = 16,
                    chunk: int = 64, serial: bool = False, stagger: int = 0, seed: int = 0) -> GreedyResult:
    """Greedy-decode ``prompts`` through the real EngineCore, scheduler and ModelRunner: all in one
    continuously batched run (sequence i joins at step ``i * stagger``) or one after the other.
    Prompts are chunked by ``chunk`` tokens per step; the KV blocks are handed out in a shuffled
    order and the cache starts as garbage, so only slots written for a sequence may be read."""
    num_blocks = sum(-(-(len(p) + max_new) // block_size) for p in prompts) + 3
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
    order = list(kv.pool.free)
    random.Random(seed).shuffle(order)
    kv.pool.free = OrderedDict((b, None) for b in order)   # non-contiguous block tables
    config = SchedulerConfig(max_num_seqs=len(prompts), max_num_batched_tokens=1 << 16,
                             long_prefill_token_threshold=chunk, admission_policy="conservative")
    runner = ModelRunner(model, num_blocks, block_size, dtype=model.dtype)
    runner.kv.data.normal_(generator=torch.Generator().manual_seed(seed))   # garbage: only written slots may be read
    recorder = _LogitsRecorder(runner)
    core = EngineCore(Scheduler(config, kv), recorder)
    reqs = [Request(f"s{i}", p, SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True))
            for i, p in enumerate(prompts)]
    steps = 0
    for group in ([[r] for r in reqs] if serial else [reqs]):
        pending = list(enumerate(group))
        step = 0
        while pending or core.has_unfinished():
            while pending and (serial or pending[0][0] * stagger <= step):
                core.add_request(pending.pop(0)[1])
            step += 1
            if core.has_unfinished():
                assert not any(u.error for u in core.step())
                steps += not core.last_plan.is_empty
    assert all(r.num_output_tokens == max_new for r in reqs)
    return GreedyResult([r.output_token_ids for r in reqs], [torch.stack(recorder.logits[r.request_id]) for r in reqs],
                        steps, recorder.mixed_steps)


def conveyor_prompt_logits(model: ConveyorModel, prompts: list[list[int]], *, block_size: int = 16,
                           chunk: int = 64, seed: int = 0) -> list[torch.Tensor]:
    """Logits at every prompt position ([len, vocab] per prompt), prompts chunked and batched together."""
    cfg = model.cfg
    tables, num_blocks = allocate_tables([len(p) for p in prompts], block_size, seed)
    kv = KVCacheTensors(cfg, num_blocks, block_size, dtype=model.dtype)
    kv.data.normal_(generator=torch.Generator().manual_seed(seed))
    done = [0] * len(prompts)
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    while any(d < len(p) for d, p in zip(done, prompts)):
        idx = [i for i, p in enumerate(prompts) if done[i] < len(p)]
        work = [SeqWork(prompts[i][done[i]:done[i] + chunk], done[i], tables[i]) for i in idx]
        inp = build_inputs(work, block_size)
        every = torch.arange(inp.input_ids.shape[0])
        with torch.inference_mode():
            logits = model(inp.input_ids, inp.positions, inp.meta, kv.layers, every)
        at = 0
        for i in inp.order:
            n = len(work[i].token_ids)
            rows[idx[i]].append(logits[at:at + n])
            at += n
            done[idx[i]] += n
    return [torch.cat(r) for r in rows]


def logit_atol(reference: torch.Tensor) -> float:
    """Absolute tolerance for fp32 logits: 1e-4 of the logit scale (see test_model_vs_hf)."""
    return 1e-4 * max(1.0, float(reference.abs().max()))


def assert_greedy_matches(got: list[int], want: list[int], got_logits: torch.Tensor | None = None,
                          want_logits: torch.Tensor | None = None, what: str = "") -> None:
    if got == want:
        return
    i = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b) if len(got) == len(want) else -1
    msg = f"{what}: greedy tokens differ at new token {i}\n got  {got}\n want {want}"
    if want_logits is not None and i >= 0:
        top = want_logits[i].topk(2).values
        msg += f"\n reference top-2 margin at that step: {float(top[0] - top[1]):.3g}"
    raise AssertionError(msg)
