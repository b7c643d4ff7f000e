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


def test_greedy_matches_transformers_on_same_gguf(demo):
    hf, tok, model = demo
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


def test_bf16_is_as_close_to_fp32_as_transformers_bf16(demo):
    """bf16 cannot match fp32 bit for bit, nor transformers' bf16 (other kernels round elsewhere).
    The tolerance is transformers' own: on the sequence Conveyor generates in bf16 (decode kernel
    reading a bf16 KV cache, oneDNN bf16 matmuls), Conveyor's bf16 logits may be at most 2x as far
    from the fp32 logits as transformers' bf16 logits are; and each greedy choice must be the fp32
    argmax wherever fp32's top-2 margin exceeds that error (below it, bf16 may break a near-tie)."""
    from conveyor.model.gguf_loader import convert_gguf
    from conveyor.model.loader import build_model, demo_model_path, load_weights, read_config

    hf32, tok, _ = demo
    path = demo_model_path()
    from transformers import AutoModelForCausalLM

    hf16 = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.bfloat16).eval()
    directory = convert_gguf(path)
    ours = build_model(read_config(directory), load_weights(directory), dtype=torch.bfloat16)
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
