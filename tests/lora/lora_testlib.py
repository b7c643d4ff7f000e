"""Helpers for the LoRA tests: a tiny random HF base model, random PEFT adapters written with peft
itself (the reference), and a driver that runs hand-built plans through the ModelRunner.

Imported by the test files of tests/lora (pytest puts this directory on sys.path: no __init__.py).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from conveyor.lora.request import LoRARequest
from conveyor.model.loader import build_model, load_weights, read_config
from conveyor.runner.model_runner import ModelRunner
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler.output import ModelOutput, NewRequestData, ScheduledSeq, SchedulerOutput

VOCAB = 128
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=256,
               rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
# llama: GQA, q_size == hidden; qwen3: q/k norms and head_dim 12 (q_size 48 != hidden 32: o_proj's
# input is not the hidden size, the k/v columns of qkv_proj start at 48).
FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2)),
            "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=12))}


def make_hf_base(family: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    """Random weights with O(1) activations and well-separated logits (no argmax ties)."""
    cfg_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**{**_COMMON, **extra, **overrides})).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (3.0 if "lm_head" in name else 1.0) / math.sqrt(p.shape[-1]))
    return model


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    r: int
    alpha: float
    targets: list[str] | str
    rslora: bool = False
    extra: dict = field(default_factory=dict)   # more LoraConfig options (rank_pattern, layers_to_transform, ...)


# Different ranks and target sets: attention only; every projection with rsLoRA; a rank and an
# alpha pattern on some MLP and attention pieces, in one layer only.
ADAPTERS = [
    AdapterSpec("attn", 4, 8, ["q_proj", "v_proj", "o_proj"]),
    AdapterSpec("all", 8, 16, "all-linear", rslora=True),
    AdapterSpec("patterned", 2, 4, ["k_proj", "gate_proj", "up_proj", "down_proj"],
                extra=dict(rank_pattern={"down_proj": 6}, alpha_pattern={"k_proj": 1.0}, layers_to_transform=[1])),
]


def write_adapter(hf_base: torch.nn.Module, directory: Path, spec: AdapterSpec, seed: int) -> torch.nn.Module:
    """A random adapter (A and B both random: init_lora_weights=False) saved in PEFT's format; returns the
    peft model, the reference."""
    torch.manual_seed(seed)
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=spec.targets, use_rslora=spec.rslora,
                        init_lora_weights=False, **spec.extra)
    model = get_peft_model(copy.deepcopy(hf_base), config).eval()
    model.save_pretrained(directory)
    return model


def with_tokenizer(directory: Path) -> str:
    """The Engine loads a tokenizer with the model: give the tiny base the demo model's."""
    import shutil

    from conveyor.model.loader import demo_model_path, model_directory

    for f in model_directory(demo_model_path()).glob("tokenizer*"):
        if not (directory / f.name).exists():
            shutil.copy(f, directory / f.name)
    return str(directory)


def load_peft(hf_base: torch.nn.Module, directory: Path) -> torch.nn.Module:
    return PeftModel.from_pretrained(copy.deepcopy(hf_base), str(directory)).eval()


def conveyor_model(hf_base: torch.nn.Module, directory: Path):
    hf_base.save_pretrained(directory)
    return build_model(read_config(directory), load_weights(directory))


def reference_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] logits of every position."""
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float()


def atol(reference: torch.Tensor) -> float:
    return 1e-4 * max(1.0, float(reference.abs().max()))


@dataclass
class _Seq:
    tokens: list[int]
    lora: LoRARequest | None
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    started: bool = False


class PlanDriver:
    """Runs hand-built plans through a ModelRunner (block tables, chunks, decodes, drafts), keeping
    each request's tokens: greedy sampling, so a request's tokens are its model's greedy continuation."""

    def __init__(self, runner: ModelRunner, block_size: int):
        self.runner = runner
        self.block_size = block_size
        self.seqs: dict[str, _Seq] = {}
        self.free = list(range(runner.kv.layers[0][0].shape[1]))
        self.steps = 0
        runner.record_logits = True

    def add(self, rid: str, prompt: list[int], lora: LoRARequest | None = None) -> None:
        self.seqs[rid] = _Seq(list(prompt), lora)

    def chunk(self, rid: str, n: int | None = None, drafts: list[int] = ()) -> ScheduledSeq:
        """The request's next `n` known tokens (default: all not yet cached), then `drafts`."""
        s = self.seqs[rid]
        known = s.tokens[s.computed:] if n is None else s.tokens[s.computed:s.computed + n]
        tokens = known + list(drafts)
        end = s.computed + len(tokens)
        grown = [self.free.pop(0) for _ in range(-(-end // self.block_size) - len(s.blocks))]
        s.blocks += grown
        new = None if s.started else NewRequestData(SamplingParams(temperature=0), 0, 0, lora=s.lora)
        seq = ScheduledSeq(rid, tokens, s.computed, grown if s.started else list(s.blocks), new,
                           sample=s.computed + len(known) == len(s.tokens), num_drafts=len(drafts))
        s.started = True
        return seq

    def step(self, seqs: list[ScheduledSeq], forget: list[str] = ()) -> ModelOutput:
        self.steps += 1
        for rid in forget:
            self.free += self.seqs.pop(rid).blocks
        plan = SchedulerOutput(self.steps, seqs, forget_ids=list(forget),
                               num_prefill_tokens=sum(s.num_tokens for s in seqs if s.num_tokens > 1),
                               num_decode_tokens=sum(s.num_tokens for s in seqs if s.num_tokens == 1))
        out = self.runner.execute(plan)
        for s in seqs:
            held = self.seqs[s.request_id]
            held.computed = s.num_computed_tokens + s.num_tokens - s.num_drafts
            if s.sample:
                accepted = out.num_accepted(s.request_id)
                held.tokens += s.draft_token_ids[:accepted] + [out.sampled[s.request_id]]
                held.computed += accepted
        return out

    def logits(self, rid: str) -> torch.Tensor:
        return self.runner.last_logits[rid]
