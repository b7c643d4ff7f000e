"""A tiny random Llama behind a real Engine (demo tokenizer for detokenization)."""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.engine.engine import Engine, EngineConfig
from conveyor.model.attention import make_attention_backend
from conveyor.model.config import ModelConfig
from conveyor.model.ops import make_ops
from conveyor.model.llama import LlamaForCausalLM
from conveyor.model.loader import LoadedModel, demo_model_path
from conveyor.tokenizer import Tokenizer

TINY = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   max_position_embeddings=1024, rope_theta=10000.0)


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    backend = make_attention_backend(TINY.num_attention_heads, TINY.num_key_value_heads, TINY.head_dim,
                                     "cpu", torch.float32)  # the C++ decode kernel when it builds
    model = LlamaForCausalLM(TINY, backend, make_ops("cpu", torch.float32))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # well-separated logits: greedy ties would make equality tests flaky
                scale = 3.0 if "lm_head" in name else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * scale / math.sqrt(p.shape[-1]))
    return model.eval()


@pytest.fixture(scope="session")
def demo_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(demo_model_path())


@pytest.fixture(scope="session")
def make_engine(demo_tokenizer):
    model = tiny_model()

    def make(num_kv_blocks: int = 512, block_size: int = 16, swap_space_gib: float = 0.05, **options) -> Engine:
        cfg = EngineConfig.from_options(num_kv_blocks=num_kv_blocks, block_size=block_size,
                                        swap_space_gib=swap_space_gib, **options)
        return Engine(cfg, loaded=LoadedModel(TINY, model, demo_tokenizer, demo_model_path(), "tiny"))

    return make
