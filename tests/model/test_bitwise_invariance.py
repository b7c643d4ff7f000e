"""Bitwise batch invariance of the default engine on a GGUF as stored (int8 kernel, AVX512-VNNI CPUs).

Its matmuls give each row the numbers it gets alone, and its prompts' attention runs through the
decode kernel query by query (``CpuPagedAttention.rowwise_prefill``), so a request's tokens **and
their logprobs, to the bit**, must not depend on what it is batched with, how its prompt is
chunked, whether its prefix came from the cache, or whether it was preempted (recomputed or
swapped). Greedy equality alone would pass on well-separated logits; bit equality of the
logprobs fails on any difference in the order of a sum (with SDPA for prompts it does: a prefix hit
computes the prompt's last token with the decode kernel, its first computation with SDPA).
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.engine.engine import Engine, EngineConfig
from conveyor.model.attention import CpuPagedAttention
from conveyor.model.cpu_kernels import load_cpu_kernels
from conveyor.model.gguf_loader import convert_gguf, gguf_native_weights
from conveyor.model.loader import LoadedModel, build_model, demo_model_path, read_config
from conveyor.model.quant import QuantLinear, row_invariant_matmuls
from conveyor.sampling.params import SamplingParams
from conveyor.tokenizer import Tokenizer
from test_quant import _tiny_quantized_gguf

KERNELS = load_cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None or not KERNELS.quant_int8_native(),
                                reason="the int8 kernel needs AVX512-VNNI")
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module", params=[("llama_tied", "llama", "Q8_0", torch.float32),
                                        ("qwen3", "qwen3", "Q4_0", torch.float32),
                                        ("llama_gqa", "llama", "Q4_1", torch.bfloat16)])
def loaded(request, tiny_models, tmp_path_factory) -> LoadedModel:
    name, arch, qtype, dtype = request.param
    tmp = tmp_path_factory.mktemp(f"invariant_{name}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CONVEYOR_CACHE_DIR", str(tmp / "cache"))
        path = _tiny_quantized_gguf(tiny_models(name).hf, tmp / f"{name}.gguf", arch, qtype)
        cfg = read_config(convert_gguf(path, weights=False))
        model = build_model(cfg, gguf_native_weights(path, cfg, (qtype,)), dtype=dtype)
    assert all(m.x16 for m in model.modules() if isinstance(m, QuantLinear)) and row_invariant_matmuls(model)
    assert isinstance(model.attn_backend, CpuPagedAttention) and model.attn_backend.rowwise_prefill
    return LoadedModel(cfg, model, Tokenizer.from_gguf(demo_model_path()), path, name)


def engine(loaded: LoadedModel, **options) -> Engine:
    options = {"num_kv_blocks": 512, "block_size": 8, "swap_space_gib": 0.05, "enable_prefix_caching": False,
               "max_num_batched_tokens": 512, **options}
    return Engine(EngineConfig.from_options(**options), loaded=loaded)


def run(eng: Engine, prompts: list[list[int]], staggered: bool = False,
        trace: list | None = None) -> list[tuple[list[int], list[float]]]:
    """Each request's tokens and their logprobs; `staggered`: the first one finishes before the others
    arrive; `trace` collects each step's (prompt tokens, decode tokens)."""
    out, order = {}, []
    for batch in [prompts[:1], prompts[1:]] if staggered else [prompts]:
        order += [eng.add_request(p, PARAMS) for p in batch]
        while eng.has_unfinished_requests():
            outputs = eng.step()
            if trace is not None:
                stats = eng.stats()
                trace.append((stats.step_prefill_tokens, stats.step_decode_tokens))
            for o in outputs:
                if o.finished:
                    c = o.outputs[0]
                    out[o.request_id] = (list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
        eng.kv.check_invariants()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks or eng.config.enable_prefix_caching
    return [out[i] for i in order]


def alone(loaded: LoadedModel, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """The reference: each prompt by itself, in one chunk, nothing cached."""
    return [run(engine(loaded), [p])[0] for p in prompts]


def make_prompts(n: int, seed: int, shared: int = 0, longest: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 250) for _ in range(shared)]
    return [prefix + [rng.randrange(1, 250) for _ in range(rng.randint(1, longest))] for _ in range(n)]


@pytest.mark.parametrize("mechanism", ["batched", "chunked", "prefix hits", "recompute", "swap"])
def test_numbers_do_not_depend_on_scheduling(loaded, mechanism):
    """Each mechanism alone, checked to have happened, gives the reference's tokens and logprobs to the bit."""
    prompts = make_prompts(8, seed=11, shared=20 if mechanism == "prefix hits" else 0)
    ref = alone(loaded, prompts)
    options = {"batched": {},
               "chunked": {"max_num_batched_tokens": 64, "long_prefill_token_threshold": 7},
               "prefix hits": {"enable_prefix_caching": True},
               "recompute": {"num_kv_blocks": 12, "preemption_mode": "recompute", "admission_policy": "optimistic",
                             "min_resident_steps": 1},
               "swap": {"num_kv_blocks": 12, "preemption_mode": "swap", "admission_policy": "optimistic",
                        "min_resident_steps": 1}}[mechanism]
    eng, trace = engine(loaded, **options), []
    got = run(eng, prompts, staggered=mechanism == "prefix hits", trace=trace)
    stats = eng.stats()
    if mechanism == "batched":   # all prompts in one step, then all decoding together
        assert trace[0][0] == sum(map(len, prompts)) and max(d for _, d in trace) == len(prompts)
    if mechanism == "chunked":   # the longest prompt needs a step per 7 tokens, beside decodes
        assert sum(1 for p, _ in trace if p) >= -(-max(map(len, prompts)) // 7)
        assert any(p and d for p, d in trace)
    if mechanism == "prefix hits":
        assert stats.prefix_cache_hits >= 7 * (20 // 8)
    if mechanism == "recompute":
        assert stats.num_recomputes > 0
    if mechanism == "swap":
        assert stats.num_swaps_out > 0
    assert got == ref


@pytest.mark.skipif(KERNELS is None or not KERNELS.int8_amx(), reason="no AMX-INT8 here")
def test_amx_tiles_are_a_reported_switch_that_changes_no_bit(loaded):
    """On an AMX-INT8 CPU steps of 16+ tokens take AMX tiles: the model reports the switch (a step-cost
    profile puts knots on both sides), and a batch whose steps take them (the first carries every
    prompt, the decodes 16 tokens) gives with AMX off the tokens and logprobs it gives with AMX on."""
    width = KERNELS.int8_amx_tokens()
    assert loaded.model.dispatch_thresholds()["int8_amx_tokens"] == width - 1
    prompts = make_prompts(width, seed=5)
    trace = []
    with_amx = run(engine(loaded), prompts, trace=trace)
    assert trace[0][0] == sum(map(len, prompts)) and max(d for _, d in trace) == width
    try:
        KERNELS.set_int8_amx(False)
        assert run(engine(loaded), prompts) == with_amx
    finally:
        KERNELS.set_int8_amx(True)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(2, 6), shared=st.sampled_from([0, 5, 16, 21]),
       block_size=st.sampled_from([4, 8, 16]), chunk=st.sampled_from([3, 16, 512]),
       blocks=st.sampled_from([12, 24, 512]), mode=st.sampled_from(["recompute", "swap"]),
       caching=st.booleans(), staggered=st.booleans())
def test_any_schedule_gives_the_same_numbers(loaded, seed, n, shared, block_size, chunk, blocks, mode, caching,
                                             staggered):
    """Batching, chunk sizes, block sizes, prefix hits and preemption mixed at random."""
    prompts = make_prompts(n, seed, shared, longest=40)
    blocks = max(blocks, -(-(max(map(len, prompts)) + PARAMS.max_tokens) // block_size))   # each fits alone
    eng = engine(loaded, num_kv_blocks=blocks, block_size=block_size, enable_prefix_caching=caching,
                 max_num_batched_tokens=max(chunk, 64), long_prefill_token_threshold=chunk, preemption_mode=mode,
                 admission_policy="optimistic", min_resident_steps=1)
    assert run(eng, prompts, staggered) == alone(loaded, prompts)


def test_sdpa_prompts_would_differ(loaded, monkeypatch):
    """The checks above can fail: with prompts' attention on SDPA, prefix hits change the numbers
    (in fp32 by a little; in bf16 the greedy tokens too)."""
    backend = loaded.model.attn_backend
    monkeypatch.setattr(backend, "rowwise_prefill", False)
    prompts = make_prompts(6, seed=3, shared=24)
    ref = alone(loaded, prompts)
    got = run(engine(loaded, enable_prefix_caching=True), prompts, staggered=True)
    assert got != ref
    if loaded.model.dtype == torch.float32:   # wide greedy margins: the same tokens, close logprobs
        assert [t for t, _ in got] == [t for t, _ in ref]
        torch.testing.assert_close(torch.tensor([x for _, lp in got for x in lp]),
                                   torch.tensor([x for _, lp in ref for x in lp]), rtol=0, atol=1e-3)


def test_a_dense_matmul_keeps_prompts_on_sdpa(tiny_models, tmp_path, monkeypatch):
    """One matmul dequantized (a q/k/v group with an F32 piece, as for a type the int8 kernel does
    not run): the model's matmuls are not all row-invariant, so prompts keep SDPA (the decode kernel
    would cost time without making the model invariant)."""
    from test_quant import _quantizing
    from test_loader import _write_tiny_gguf

    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    add_tensor = _quantizing(lambda name: None if "attn_v" in name else "Q8_0")
    path = _write_tiny_gguf(tiny_models("llama_gqa").hf, tmp_path / "mixed.gguf", "llama", add_tensor=add_tensor)
    cfg = read_config(convert_gguf(path, weights=False))
    model = build_model(cfg, gguf_native_weights(path, cfg, ("Q8_0",)))
    assert not isinstance(model.layers[0].self_attn.qkv_proj, QuantLinear)
    assert not row_invariant_matmuls(model) and not model.attn_backend.rowwise_prefill
    assert "prefill_rowwise" not in model.dispatch_thresholds()
    monkeypatch.setenv("CONVEYOR_BATCH_INVARIANT", "on")
    forced = build_model(cfg, gguf_native_weights(path, cfg, ("Q8_0",)))
    assert forced.attn_backend.rowwise_prefill and forced.dispatch_thresholds()["prefill_rowwise"] == 1
