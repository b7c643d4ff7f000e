"""The real demo model (SmolLM2-135M-Instruct, Q4_1 GGUF) vs transformers loading the same file.

transformers dequantizes the GGUF itself and maps llama.cpp's permuted Q/K rows back with its
own code, so agreement independently checks Conveyor's GGUF conversion (dequantization, Q/K
un-permutation for 9 query / 3 KV heads, tied embeddings, config) and its decoder at scale.
Both run the same fp32 weights; 30 layers of hidden 576 accumulate more rounding than the tiny
models, but it stays ~1.5e-6 of the logit scale (5e-5 absolute on logits up to ~38), so the
1e-4-of-scale tolerance still holds; the smallest top-2 gap on these prompts is ~0.06.
"""

from __future__ import annotations

import pytest
import torch

from model_testlib import assert_greedy_matches, conveyor_greedy, logit_atol

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.\nThe waves",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def demo():
    from conveyor.model.gguf_loader import convert_gguf
    from conveyor.model.loader import ModelNotFoundError, build_model, demo_model_path, load_weights, read_config

    try:
        path = demo_model_path()
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    # Like ignore_eos: plain argmax for MAX_NEW steps, as our loop does. (min_new_tokens would
    # instead mask EOS out of the argmax.)
    hf.generation_config.eos_token_id = None
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    directory = convert_gguf(path)
    cfg = read_config(directory)
    return hf, tok, build_model(cfg, load_weights(directory))


def test_config_matches_transformers(demo):
    hf, _, model = demo
    c, h = model.cfg, hf.config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (
        h.num_hidden_layers, h.hidden_size, h.intermediate_size)
    assert (c.num_attention_heads, c.num_key_value_heads) == (h.num_attention_heads, h.num_key_value_heads)
    assert c.vocab_size == h.vocab_size and c.tie_word_embeddings == h.tie_word_embeddings
    assert c.rope_theta == h.rope_parameters["rope_theta"]
    assert c.rms_norm_eps == pytest.approx(h.rms_norm_eps)


def _quantized_demo(dtype: torch.dtype, int8: bool | None = False):
    """The demo model with its Q4_1/Q8_0 blocks kept as stored (the default for a GGUF), with fp32
    activations (`--quantization weight-only`), int8 ones, or (None) as `auto` chooses here."""
    from conveyor.model.gguf_loader import convert_gguf, gguf_native_weights
    from conveyor.model.loader import build_model, demo_model_path, read_config
    from conveyor.model.quant import QuantLinear, native_available

    if not native_available("cpu", dtype):
        pytest.skip("quantized kernels not built here")
    path = demo_model_path()
    cfg = read_config(convert_gguf(path, weights=False))
    model = build_model(cfg, gguf_native_weights(path, cfg, ("Q4_1", "Q8_0")), dtype=dtype, int8_activations=int8)
    assert isinstance(model.cpu_lm_head, QuantLinear) and isinstance(model.layers[0].mlp.down_proj, QuantLinear)
    return model


@pytest.mark.parametrize("quantized", [False, True], ids=["dequantized", "quantized"])
def test_greedy_matches_transformers_on_same_gguf(demo, quantized):
    """Dequantized at load, or computed from the Q4_1/Q8_0 blocks as stored: the same weights,
    so the same tolerance against transformers (only the order of the sums differs)."""
    hf, tok, model = demo
    if quantized:
        model = _quantized_demo(torch.float32)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts)
    got = conveyor_greedy(model, prompts, MAX_NEW, block_size=16, chunk=8, stagger=2)
    assert got.mixed_steps > 0
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)
        assert out.sequences.shape[1] == len(prompt) + MAX_NEW
        want, want_logits = out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()
        assert_greedy_matches(got.tokens[i], want, got.logits[i], want_logits, f"demo prompt {i}")
        torch.testing.assert_close(got.logits[i], want_logits, rtol=0, atol=logit_atol(want_logits))


@pytest.mark.parametrize("quantized", [pytest.param(False, marks=pytest.mark.heavy), True],
                         ids=["dequantized", "quantized"])
def test_bf16_is_as_close_to_fp32_as_transformers_bf16(demo, quantized):
    """bf16 cannot match fp32 bit for bit, nor transformers' bf16 (other kernels round elsewhere).
    The tolerance is transformers' own: on the sequence Conveyor generates in bf16 (decode kernel
    reading a bf16 KV cache, oneDNN bf16 matmuls), Conveyor's bf16 logits may be at most 2x as far
    from the fp32 logits as transformers' bf16 logits are; and each greedy choice must be the fp32
    argmax wherever fp32's top-2 margin exceeds that error (below it, bf16 may break a near-tie).
    Quantized as `auto` runs it here: the int8 kernel on VNNI CPUs without AMX (exact weights,
    activations in two int8 terms per block), else the bf16 kernel (weights rounded to bf16)."""
    from conveyor.model.gguf_loader import convert_gguf
    from conveyor.model.loader import build_model, demo_model_path, load_weights, read_config

    hf32, tok, _ = demo
    path = demo_model_path()
    from transformers import AutoModelForCausalLM

    hf16 = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.bfloat16).eval()
    directory = convert_gguf(path)
    ours = _quantized_demo(torch.bfloat16, int8=None) if quantized else \
        build_model(read_config(directory), load_weights(directory), dtype=torch.bfloat16)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    run = conveyor_greedy(ours, prompts, MAX_NEW, block_size=16, chunk=8, stagger=2)
    for i, prompt in enumerate(prompts):
        seq = torch.tensor([prompt + run.tokens[i]])
        with torch.inference_mode():
            ref = hf32(seq).logits[0, len(prompt) - 1:-1].float()
            theirs = hf16(seq).logits[0, len(prompt) - 1:-1].float()
        mine = run.logits[i].float()
        err_hf, err_ours = (theirs - ref).abs().max().item(), (mine - ref).abs().max().item()
        print(f"prompt {i}: max |bf16 - fp32| logit error: Conveyor {err_ours:.3f}, transformers {err_hf:.3f}")
        assert err_ours <= 2 * err_hf, f"prompt {i}: bf16 error {err_ours:.3f} vs transformers' {err_hf:.3f}"
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * err_hf
        chosen = torch.tensor(run.tokens[i])
        assert clear.any()
        assert torch.equal(chosen[clear], ref.argmax(-1)[clear]), f"prompt {i}: a clear fp32 choice flipped"


# A fixed text set for scoring quantized paths position by position (teacher forcing).
TEXTS = [
    "The river rose three feet overnight, and by morning the lower fields were under water. Farmers moved "
    "their cattle to the ridge, where the old stone barn still stood, and waited for the rain to stop.",
    "To install the package, first create a virtual environment, activate it, and run pip install with the "
    "requirements file. If the build fails on a missing compiler, install the build tools and try again.",
    "def merge_sorted(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
    "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts of plant cells, "
    "chlorophyll absorbs light, and the energy drives the synthesis of glucose from carbon dioxide and water.",
    "The treaty was signed in 1648 after decades of war that had devastated much of central Europe. It "
    "established principles of sovereignty that shaped the relations between states for centuries.",
]


def test_int8_activations_agree_with_the_dequantized_model(demo):
    """The default on VNNI CPUs (activations as two int8 terms per block of 32) scored against the
    dequantized fp32 model on the same texts: greedy choices agree at >= 99% of positions and the
    per-token KL divergence (llama.cpp's --kl-divergence idea) stays small."""
    from conveyor.model.quant import int8_activations_native
    from model_testlib import conveyor_prompt_logits

    if not int8_activations_native():
        pytest.skip("no AVX512-VNNI here")
    _, tok, dense = demo
    model = _quantized_demo(torch.float32, int8=True)
    assert model.cpu_lm_head.x16
    ids = [tok(t)["input_ids"] for t in TEXTS]
    agree = total = 0
    kls = []
    for got, ref in zip(conveyor_prompt_logits(model, ids), conveyor_prompt_logits(dense, ids)):
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        total += ref.shape[0]
        p, q = ref.log_softmax(-1), got.log_softmax(-1)
        kls.append((p.exp() * (p - q)).sum(-1))
    kl = torch.cat(kls)
    print(f"int8 activations: {agree}/{total} greedy positions agree; KL mean {kl.mean():.2e}, max {kl.max():.2e}")
    assert agree >= 0.99 * total and kl.mean() < 1e-3
