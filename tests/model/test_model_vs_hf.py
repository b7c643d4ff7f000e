"""Conveyor's decoder vs Hugging Face transformers on the same tiny random checkpoints.

Tolerance: fp32 logits must agree within ``1e-4 * max(1, max|logit|)`` (model_testlib.logit_atol).
Both sides compute the same math in fp32 but in a different order (fused q/k/v and gate/up
matmuls, paged gather + SDPA vs HF's attention, padded decode rows), so they differ by
rounding only: fp32 epsilon is 1.2e-7, and a 2-layer, hidden-64 model accumulates a few
hundred such roundings per logit -- we observe ~5e-7 of the logit scale. 1e-4 leaves ~200x
headroom for other CPUs/BLAS kernels, while any real bug (a wrong RoPE frequency, a missing
bias or norm, a wrong K/V slot or mask) moves logits by O(1) of their scale. The tiny models
are built so that the reference's top-2 logit gap is >= ~4e-3 at every greedy step, far above
that rounding, so greedy token ids must match exactly.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from conveyor.model.config import ModelConfig
from conveyor.model.loader import build_model, load_weights
from model_testlib import LLAMA3_SCALING, assert_greedy_matches, conveyor_greedy, conveyor_prompt_logits
from model_testlib import logit_atol, random_prompts

PROMPT_LENGTHS = [1, 6, 19, 47, 130]
MAX_NEW = 32


def test_fixture_weights_are_nontrivial(family):
    """The checks below only mean something if biases and norms are not the HF init (0 and 1)."""
    sd = family.hf.state_dict()
    norms = [v for k, v in sd.items() if "norm" in k]
    assert all(not torch.allclose(v, torch.ones_like(v)) for v in norms)
    if family.name == "qwen2":
        biases = [k for k in sd if k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))]
        assert len(biases) == 3 * 2 and all(sd[k].abs().min() > 0 for k in biases)
    if family.name == "qwen3":
        assert any("q_norm" in k for k in sd) and any("k_norm" in k for k in sd)


def test_config_parsed_from_hf(family):
    cfg, hf = family.cfg, family.hf.config
    assert cfg.model_type == hf.model_type
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (hf.num_attention_heads, hf.num_key_value_heads)
    assert cfg.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    rope = hf.rope_parameters.get("full_attention", hf.rope_parameters)   # Gemma 3: one per layer type
    assert cfg.rope_theta == rope["rope_theta"]
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert cfg.attention_bias == (family.name == "qwen2")
    assert cfg.qk_norm == (family.name in ("qwen3", "gemma3"))
    if family.name == "gemma3":
        assert cfg.rope_local_theta == hf.rope_parameters["sliding_attention"]["rope_theta"]
        assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
        assert [cfg.layer_window(i) for i in range(3)] == [8, 0, 8]
        assert cfg.attention_scale == 24 ** -0.5 and cfg.embedding_multiplier == 8.0
        return
    if family.name == "qwen3":
        assert cfg.head_dim == 24 and cfg.q_size != cfg.hidden_size
    if family.name == "llama3_rope":
        assert cfg.rope_theta == 50000.0
        assert cfg.rope_scaling is not None
        assert {k: cfg.rope_scaling[k] for k in LLAMA3_SCALING} == LLAMA3_SCALING
    else:
        assert cfg.rope_scaling is None


def test_config_round_trips(family):
    cfg = family.cfg
    again = ModelConfig.from_hf(cfg.to_hf())
    assert again == cfg
    # transformers reads our to_hf() output back into the same architecture.
    hf = AutoConfig.for_model(**cfg.to_hf())
    assert hf.rope_parameters.get("full_attention", hf.rope_parameters)["rope_theta"] == cfg.rope_theta
    assert hf.tie_word_embeddings == cfg.tie_word_embeddings
    if family.name == "gemma3":
        assert hf.layer_types == list(cfg.layer_types) and hf.sliding_window == cfg.sliding_window
        assert hf.rope_parameters["sliding_attention"]["rope_theta"] == cfg.rope_local_theta
        assert hf.query_pre_attn_scalar == cfg.query_pre_attn_scalar
    elif cfg.rope_scaling:
        assert {k: hf.rope_parameters[k] for k in LLAMA3_SCALING} == LLAMA3_SCALING


def test_legacy_rope_config_form():
    """transformers < 5 wrote top-level rope_theta and rope_scaling; both forms parse the same."""
    base = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)
    old = ModelConfig.from_hf(dict(base, rope_theta=50000.0, rope_scaling=dict(LLAMA3_SCALING)))
    new = ModelConfig.from_hf(dict(base, rope_parameters=dict(LLAMA3_SCALING, rope_theta=50000.0)))
    assert old.rope_theta == new.rope_theta == 50000.0
    assert {k: old.rope_scaling[k] for k in LLAMA3_SCALING} == {k: new.rope_scaling[k] for k in LLAMA3_SCALING}
    plain = ModelConfig.from_hf(dict(base, rope_parameters={"rope_type": "default", "rope_theta": 123.0}))
    assert plain.rope_theta == 123.0 and plain.rope_scaling is None


def test_legacy_gemma3_config_form():
    """Gemma 3 configs before transformers 5: rope_theta/rope_scaling for the global layers,
    rope_local_base_freq for the sliding ones, and sliding_window_pattern instead of layer_types."""
    base = dict(model_type="gemma3_text", vocab_size=256, hidden_size=64, intermediate_size=128,
                num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=8)
    old = ModelConfig.from_hf(dict(base, rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0},
                                   rope_local_base_freq=1e4, sliding_window_pattern=6))
    assert old.rope_theta == 1e6 and old.rope_local_theta == 1e4
    assert old.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert [old.layer_window(i) for i in range(7)] == [8] * 5 + [0, 8]
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        ModelConfig.from_hf(dict(base, final_logit_softcapping=30.0))


def test_greedy_matches_hf_generate(family):
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    got = conveyor_greedy(family.model, prompts, MAX_NEW, block_size=16, chunk=64, stagger=2)
    assert got.mixed_steps > 0
    for i, prompt in enumerate(prompts):
        want, want_logits = family.hf_greedy(prompt, MAX_NEW)
        assert_greedy_matches(got.tokens[i], want, got.logits[i], want_logits, f"{family.name} prompt {i}")
        torch.testing.assert_close(got.logits[i], want_logits, rtol=0, atol=logit_atol(want_logits))


@pytest.mark.parametrize("chunk", [7, 64])
def test_prefill_logits_match_hf(family, chunk):
    """Logits at every prompt position, the prompts chunked and batched together."""
    prompts = random_prompts(PROMPT_LENGTHS, seed=2)
    got = conveyor_prompt_logits(family.model, prompts, block_size=16, chunk=chunk)
    for prompt, logits in zip(prompts, got):
        with torch.inference_mode():
            want = family.hf(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(logits, want, rtol=0, atol=logit_atol(want))


def test_positions_past_llama3_original_context(tiny_models):
    """llama3 scaling only changes low frequencies; a prompt far past
    original_max_position_embeddings (64) exercises it, up to max_position_embeddings."""
    fam = tiny_models("llama3_rope")
    prompt = random_prompts([400], seed=3)[0]
    got = conveyor_greedy(fam.model, [prompt], 16, block_size=16, chunk=128)
    want, want_logits = fam.hf_greedy(prompt, 16)
    assert_greedy_matches(got.tokens[0], want, got.logits[0], want_logits, "llama3 long prompt")
    torch.testing.assert_close(got.logits[0], want_logits, rtol=0, atol=logit_atol(want_logits))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk", [1, 7])   # chunk 1: every token after the first takes the decode path
def test_half_precision(tiny_models, dtype, chunk):
    """A bf16/fp16 model (KV cache in the same dtype) runs end to end and stays near fp32 HF.
    Loose bound: bf16 keeps 8 mantissa bits (eps 7.8e-3), and weights, activations and the
    cache are all rounded to it (measured: 1% of the logit scale for bf16, 0.13% for fp16);
    5% still catches any structural error, which moves logits by O(100%)."""
    fam = tiny_models("qwen3")
    model = build_model(fam.cfg, load_weights(fam.path), dtype=dtype)
    prompts = random_prompts([1, 23], seed=6)
    for prompt, got in zip(prompts, conveyor_prompt_logits(model, prompts, block_size=16, chunk=chunk)):
        assert got.dtype == dtype
        with torch.inference_mode():
            want = fam.hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(got.float(), want, rtol=0, atol=0.05 * float(want.abs().max()))
