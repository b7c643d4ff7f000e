"""Mixture-of-experts models (Qwen3-MoE, Mixtral): the same logits and greedy tokens as
transformers, from HF checkpoints and from GGUF files (experts merged in 3-D tensors, as
llama.cpp writes them), in F32 and kept quantized as stored; through the whole engine with mixed
prefill/decode steps, prefix-cache hits and preemption (swap and recompute).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from conveyor.bench.synthetic_gguf import BLOCK_BYTES, _blocks
from conveyor.engine.llm import LLM
from conveyor.model.gguf_loader import convert_gguf, gguf_native_weights
from conveyor.model.cpu_kernels import load_cpu_kernels
from conveyor.model.llama import MLP, SparseMoE
from conveyor.model.loader import build_model, expert_weights, load_weights, read_config
from conveyor.model.quant import QuantLinear, QuantTensor
from conveyor.sampling.params import SamplingParams

from test_loader import _gguf_arrays, _write_tiny_gguf
from model_testlib import (MOE_FAMILIES, assert_greedy_matches, conveyor_greedy, conveyor_prompt_logits, logit_atol,
                           random_prompts, with_tokenizer)

FAMILY_NAMES = ["mixtral", "qwen3_moe"]
KERNELS = load_cpu_kernels()


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_moe_model_matches_transformers(tiny_models, name):
    """Prompt logits (prompts chunked and batched together) and greedy tokens in one continuous
    batch with staggered arrivals (steps mixing prefill chunks and decodes) equal transformers'."""
    fam = tiny_models(name)
    cfg = fam.cfg
    assert cfg.model_type == name and cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
    assert cfg.norm_topk_prob == (name == "mixtral")
    assert cfg.dense_mlp_layers == ((1,) if name == "qwen3_moe" else ())
    kinds = [type(layer.mlp) for layer in fam.model.layers]
    assert kinds == ([SparseMoE, MLP, SparseMoE] if name == "qwen3_moe" else [SparseMoE, SparseMoE])
    prompts = random_prompts([1, 9, 40], seed=4)
    for prompt, got in zip(prompts, conveyor_prompt_logits(fam.model, prompts, chunk=16)):
        with torch.inference_mode():
            want = fam.hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(got, want, rtol=0, atol=logit_atol(want))
    run = conveyor_greedy(fam.model, prompts, 12, chunk=8, stagger=2)
    assert run.mixed_steps > 0
    for i, prompt in enumerate(prompts):
        want, want_logits = fam.hf_greedy(prompt, 12)
        assert_greedy_matches(run.tokens[i], want, run.logits[i], want_logits, f"{name} prompt {i}")
        torch.testing.assert_close(run.logits[i], want_logits, rtol=0, atol=logit_atol(want_logits))


def test_a_step_runs_each_expert_it_touches_once(tiny_models):
    """The tokens of a step are grouped by expert: each expert the step routes to runs once over
    all its tokens (an expert shared by several tokens is read once), a lone token only its k
    (here through the Python loop; the one-call kernel: the test below)."""
    moe = tiny_models("mixtral").model.layers[0].mlp
    kernels, moe.kernels = moe.kernels, None
    calls: list[int] = []
    for e in moe.experts:
        forward = e.forward
        e.forward = lambda x, lora=None, f=forward: calls.append(x.shape[0]) or f(x)
    try:
        x = torch.randn(16, moe.gate.in_features)
        _, ids = moe.route(x)
        out = moe.forward(x)
        assert len(calls) == len(set(ids.flatten().tolist())) == moe.last_experts < 16 * 2
        assert sum(calls) == 16 * 2
        calls.clear()
        rows = [moe.forward(x[i:i + 1]) for i in range(16)]
        assert calls == [1] * 32 and moe.last_experts == 2
        torch.testing.assert_close(torch.cat(rows), out, rtol=0, atol=1e-6)
    finally:
        moe.kernels = kernels
        for e in moe.experts:
            del e.forward


def test_mixtral_names_and_stacked_experts_load_alike(tiny_models):
    """Mixtral's checkpoint names (block_sparse_moe, w1/w2/w3) and experts stacked in 3-D tensors
    (transformers 5's in-memory layout) come to the same weights."""
    fam = tiny_models("mixtral")
    saved = load_weights(fam.path)
    assert not any("block_sparse_moe" in k or ".w1." in k for k in saved)
    stacked = expert_weights({k: v.clone() for k, v in fam.hf.state_dict().items()})
    assert set(stacked) == set(saved)
    for k in saved:
        torch.testing.assert_close(stacked[k], saved[k], rtol=0, atol=0)


# --- GGUF, as llama.cpp's convert_hf_to_gguf.py writes these models -------------------------------

def _gguf_tensors(hf) -> dict[str, np.ndarray]:
    """GGUF-named fp32 arrays of an HF MoE model: the experts (transformers 5 holds them stacked,
    [E, 2I, H] and [E, H, I]) as llama.cpp's merged ffn_{gate,up,down}_exps ([experts, rows,
    columns]), the rest as for a dense model (the router as ffn_gate_inp; Mixtral's Q/K permuted)."""
    arch = _arch(hf)
    out = {}
    for name, t in hf.state_dict().items():
        if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            continue
        a = t.detach().float().numpy()
        idx = name.split(".")[2]
        if name.endswith("gate_up_proj"):
            half = a.shape[1] // 2
            out[f"blk.{idx}.ffn_gate_exps.weight"] = np.ascontiguousarray(a[:, :half])
            out[f"blk.{idx}.ffn_up_exps.weight"] = np.ascontiguousarray(a[:, half:])
        else:
            out[f"blk.{idx}.ffn_down_exps.weight"] = a.copy()
    rest = {k for k in hf.state_dict() if ".mlp.experts." not in k}
    return {**dict(_gguf_arrays(hf, arch, rest)), **out}


def _arch(hf) -> str:
    return "llama" if hf.config.model_type == "mixtral" else "qwen3moe"


def _write_moe_gguf(hf, path, qtype: str | None = None):
    """`hf` as a GGUF file ("qwen3moe", or "llama" with experts for Mixtral); with `qtype`, every
    matrix but the routers (which llama.cpp keeps in F32) and the norms stored in that type; a
    K-quant (which the gguf package cannot write) only for the experts, as random blocks."""
    c = hf.config
    arch = _arch(hf)

    def metadata(w) -> None:
        w.add_expert_count(c.num_experts if arch == "qwen3moe" else c.num_local_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        if arch == "qwen3moe":
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
            w.add_expert_weights_norm(c.norm_topk_prob)

    rng = np.random.default_rng(0)

    def add_tensor(w, name: str, a: np.ndarray) -> None:
        if qtype in BLOCK_BYTES and qtype.endswith("_K") and a.ndim == 3:
            data = np.stack([_blocks(rng, a.shape[1], a.shape[2], qtype) for _ in range(a.shape[0])])
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType[qtype])
        elif qtype is None or a.ndim == 1 or "ffn_gate_inp" in name or qtype.endswith("_K"):
            w.add_tensor(name, a)
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            data = gguf.quants.quantize(a, kind)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)

    return _write_tiny_gguf(hf, path, arch, add_tensor, _gguf_tensors(hf), metadata)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_moe_gguf_matches_transformers(tiny_models, tmp_path, monkeypatch, name):
    """An F32 GGUF of each model (merged expert tensors, the router as ffn_gate_inp, Mixtral's Q/K
    rows permuted): its config and its logits are transformers'."""
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    fam = tiny_models(name)
    directory = convert_gguf(_write_moe_gguf(fam.hf, tmp_path / f"{name}.gguf"))
    cfg = read_config(directory)
    for field in ("model_type", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "dense_mlp_layers", "qk_norm", "head_dim", "num_key_value_heads"):
        assert getattr(cfg, field) == getattr(fam.cfg, field), field
    model = build_model(cfg, load_weights(directory))
    prompts = random_prompts([1, 9, 40], seed=6)
    for prompt, got in zip(prompts, conveyor_prompt_logits(model, prompts, chunk=16)):
        with torch.inference_mode():
            want = fam.hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(got, want, rtol=0, atol=logit_atol(want))


@pytest.mark.parametrize("name, qtype", [("qwen3_moe", "Q8_0"), ("mixtral", "Q4_0"), ("qwen3_moe_256", "Q4_K")])
def test_quantized_moe_gguf_equals_its_dequantized_self(tiny_models, tmp_path, monkeypatch, name, qtype):
    """Experts kept as the file's blocks (one QuantTensor per expert, never dequantized), routers
    dense: the same logits and greedy tokens as the same file dequantized at load (fp32
    activations); K-quants, which run on the int8-activation kernel only, within 1e-3 of the
    logits' scale up to the first token where the two differ."""
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    int8 = qtype == "Q4_K"
    if int8 and (KERNELS is None or not KERNELS.quant_int8_native()):
        pytest.skip("K-quants run on the int8 kernel: no AVX512-VNNI or AVX2 here")
    path = _write_moe_gguf(tiny_models(name).hf, tmp_path / f"{name}-{qtype}.gguf", qtype)
    cfg = read_config(convert_gguf(path, weights=False))
    weights = gguf_native_weights(path, cfg, (qtype,))
    experts = [k for k in weights if ".experts." in k]
    assert len(experts) == 3 * 8 * (cfg.num_hidden_layers - len(cfg.dense_mlp_layers))
    assert all(isinstance(weights[k], QuantTensor) for k in experts)
    assert all(not isinstance(v, QuantTensor) for k, v in weights.items() if k.endswith("mlp.gate.weight"))
    quant = build_model(cfg, weights, int8_activations=None if int8 else False)
    dense = build_model(cfg, load_weights(convert_gguf(path)))
    moe = quant.layers[0].mlp
    assert isinstance(moe, SparseMoE) and all(isinstance(e.gate_up_proj, QuantLinear) for e in moe.experts)
    assert quant.fused_decode_tokens == 0   # MoE steps take the Python layer loop
    prompts = random_prompts([1, 9, 40], seed=7)
    for got, want in zip(conveyor_prompt_logits(quant, prompts, chunk=16),
                         conveyor_prompt_logits(dense, prompts, chunk=16)):
        if int8:
            assert (got - want).abs().max() <= 1e-3 * want.abs().max()
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=logit_atol(want))
    got, want = conveyor_greedy(quant, prompts, 10), conveyor_greedy(dense, prompts, 10)
    for i in range(len(prompts)):
        if int8:   # up to the first differing token (after it the contexts differ)
            n = next((j for j, (a, b) in enumerate(zip(got.tokens[i], want.tokens[i])) if a != b), 9) + 1
            assert (got.logits[i][:n] - want.logits[i][:n]).abs().max() <= 1e-3 * want.logits[i][:n].abs().max()
        else:
            assert_greedy_matches(got.tokens[i], want.tokens[i], got.logits[i], want.logits[i], f"prompt {i}")


GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_moe_through_the_engine_with_prefix_hits_and_preemption(tiny_models, name):
    """The engine's greedy tokens equal transformers' with prefix-cache hits and under a cache
    small enough that requests preempt one another, by swap and by recompute."""
    fam = tiny_models(name)
    path = with_tokenizer(fam.path)
    shared = random_prompts([24], seed=11)[0]
    prompts = [shared + tail for tail in random_prompts([6, 14, 26, 9, 20, 3], seed=12)]
    want = [fam.hf_greedy(p, GREEDY.max_tokens)[0] for p in prompts]
    for mode in ("swap", "recompute"):
        with LLM(path, dtype="float32", cost_model="none", num_kv_blocks=14, block_size=8, preemption_mode=mode,
                 admission_policy="optimistic", max_num_seqs=6, long_prefill_token_threshold=16) as llm:
            reqs = [{"prompt_token_ids": p} for p in prompts]
            llm.generate(reqs[:1], GREEDY, use_tqdm=False)   # its blocks cached: the others' prefix hits
            outs = llm.generate(reqs, GREEDY, use_tqdm=False)
            stats = llm.stats()
        assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0, mode
        assert stats.kv_invariant_checks > 0 and stats.kv_invariant_violations == 0
        assert [o.outputs[0].token_ids for o in outs] == want, mode


@pytest.mark.skipif(KERNELS is None, reason="the C++ kernels do not build here")
@pytest.mark.parametrize("qtype, int8, dtype", [("Q8_0", False, torch.float32), ("Q8_0", None, torch.float32),
                                                ("Q4_0", None, torch.bfloat16), ("Q4_K", None, torch.bfloat16)])
def test_the_routed_mlp_in_one_call_gives_the_python_loops_bits(tiny_models, tmp_path, monkeypatch, qtype, int8, dtype):
    """Steps whose experts take their tokens on the C++ kernels run the whole routed MLP in one
    call (grouped by expert: gate/up, activation, down, weighted sums): the same bits as the
    per-expert loop, for one token and for several, quantized experts on either kernel, fp32 and
    bf16 -- so a token's numbers do not depend on which path its step took."""
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    if qtype == "Q4_K" and not KERNELS.quant_int8_native():
        pytest.skip("K-quants run on the int8 kernel: no AVX512-VNNI or AVX2 here")
    name = "qwen3_moe_256" if qtype == "Q4_K" else "mixtral"
    path = _write_moe_gguf(tiny_models(name).hf, tmp_path / f"{name}-{qtype}.gguf", qtype)
    cfg = read_config(convert_gguf(path, weights=False))
    model = build_model(cfg, gguf_native_weights(path, cfg, (qtype,)), dtype=dtype, int8_activations=int8)
    moe = model.layers[0].mlp
    assert moe.kernels is not None and moe.kernel_tokens >= 8
    g = torch.Generator().manual_seed(3)
    for tokens in (1, 1, 3, 9):
        x = torch.randn(tokens, cfg.hidden_size, generator=g).to(dtype)
        with torch.inference_mode():
            assert torch.bincount(moe.route(x)[1].flatten()).max() <= moe.kernel_tokens   # the kernel takes it
            got = moe.forward(x)
            kernels, moe.kernels = moe.kernels, None
            try:
                want = moe.forward(x)
            finally:
                moe.kernels = kernels
        assert torch.equal(got, want), tokens
