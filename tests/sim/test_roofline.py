"""Sanity of the GPU roofline model: decode pays for bytes, prefill for FLOPs, links for swaps and TP."""

from __future__ import annotations

from dataclasses import replace

import pytest

from conveyor.sim.cost import StepShape
from conveyor.sim.roofline import GPUS, MODEL_PRESETS, RooflineCostModel, model_shape

LLAMA8B = MODEL_PRESETS["llama-3.1-8b"]


def decode(batch: int, context: int) -> StepShape:
    return StepShape(decode_tokens=batch, decode_context=batch * (context + 1), num_seqs=batch, num_sampled=batch)


def prefill(n: int, cached: int = 0) -> StepShape:
    return StepShape(prefill_tokens=n, prefill_context=cached, prefill_attention=n * (cached + (n + 1) / 2),
                     num_seqs=1, num_sampled=1)


def test_preset_parameter_counts_match_the_published_sizes():
    assert LLAMA8B.params == pytest.approx(8.03e9, rel=0.01)
    assert MODEL_PRESETS["llama-3.1-70b"].params == pytest.approx(70.6e9, rel=0.01)
    assert MODEL_PRESETS["smollm2-135m"].params == pytest.approx(134.5e6 + 49152 * 576, rel=0.02)  # untied here


def test_decode_is_bandwidth_bound_and_grows_with_the_kv_read():
    m = RooflineCostModel(GPUS["h200"], LLAMA8B)
    short, long = m.shape_time(decode(32, 512)), m.shape_time(decode(32, 8192))
    assert long > short * 1.5
    s = decode(32, 4096)
    assert m.bytes(s) / (m.gpu.hbm_bw * m.bandwidth_efficiency) > m.flops(s) / (m.gpu.bf16_flops * m.compute_efficiency)
    # ~16 GB of weights at 4.8 TB/s * 0.8 is ~4 ms: a batch-1 decode step is about that
    assert 3e-3 < m.shape_time(decode(1, 128)) < 6e-3


def test_doubling_bandwidth_roughly_halves_a_decode_step():
    m = RooflineCostModel(GPUS["h100"], LLAMA8B, step_overhead=0.0)
    fast = replace(m, gpu=replace(m.gpu, hbm_bw=2 * m.gpu.hbm_bw))
    s = decode(16, 2048)
    assert fast.shape_time(s) == pytest.approx(m.shape_time(s) / 2, rel=0.01)


def test_prefill_is_compute_bound_and_grows_with_flops():
    m = RooflineCostModel(GPUS["h200"], LLAMA8B)
    s = prefill(4096)
    assert m.flops(s) / (m.gpu.bf16_flops * m.compute_efficiency) > m.bytes(s) / (m.gpu.hbm_bw * m.bandwidth_efficiency)
    assert m.shape_time(prefill(8192)) > 1.9 * m.shape_time(prefill(4096)) - m.step_overhead
    assert m.shape_time(prefill(2048, cached=8192)) > m.shape_time(prefill(2048))
    faster = replace(m, gpu=replace(m.gpu, bf16_flops=2 * m.gpu.bf16_flops))
    assert faster.shape_time(prefill(8192)) < 0.55 * m.shape_time(prefill(8192)) + m.step_overhead


def test_tensor_parallel_splits_the_work_and_pays_all_reduces():
    one = RooflineCostModel(GPUS["h100"], MODEL_PRESETS["llama-3.1-70b"], tp=1)
    two = replace(one, tp=2)
    s = decode(64, 1024)
    assert two.allreduce_time(s) > 0 and one.allreduce_time(s) == 0
    assert two.shape_time(s) < one.shape_time(s)
    with pytest.raises(ValueError, match="does not fit"):
        one.num_kv_blocks()                  # 141 GB of bf16 weights on one 80 GB GPU
    assert replace(one, tp=8).num_kv_blocks() > 2 * replace(one, tp=4).num_kv_blocks() > 0
    l4 = RooflineCostModel(GPUS["l4"], LLAMA8B, tp=2)   # no NVLink: all-reduces cross PCIe
    assert l4.allreduce_time(s) > replace(l4, gpu=GPUS["h100"]).allreduce_time(s)


def test_swaps_cross_pcie_and_kv_capacity_follows_memory():
    h200, a100 = RooflineCostModel(GPUS["h200"], LLAMA8B), RooflineCostModel(GPUS["a100"], LLAMA8B)
    assert a100.swap_time(100) == pytest.approx(2 * h200.swap_time(100))   # PCIe 4 vs 5
    assert h200.num_kv_blocks() > 1.9 * a100.num_kv_blocks()   # (141 - 16) vs (80 - 16) GB, minus headroom
    with pytest.raises(ValueError, match="does not fit"):
        RooflineCostModel(GPUS["l4"], MODEL_PRESETS["llama-3.1-70b"]).num_kv_blocks()


def test_model_shape_from_an_hf_config(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,'
                                          ' "intermediate_size": 128, "vocab_size": 256}')
    shape = model_shape(str(tmp_path))
    assert shape.kv_heads == 4 and shape.head_dim == 16 and shape.kv_bytes_per_token(2) == 2 * 2 * 4 * 16 * 2
    with pytest.raises(ValueError, match="preset"):
        model_shape("no-such-model")


def test_moe_steps_read_the_experts_their_tokens_route_to():
    """Qwen3-30B-A3B: 30.5B parameters, ~3.3B active per token. A batch-1 decode reads the
    attention, the routers and 8 of 128 experts per layer; a large batch reads nearly all of them,
    so its step costs about what a dense 30B model's does, while its FLOPs stay those of 3B."""
    moe = MODEL_PRESETS["qwen3-30b-a3b"]
    assert moe.params == pytest.approx(30.5e9, rel=0.02)
    assert moe.active_params + 2 * moe.vocab * moe.hidden == pytest.approx(3.3e9, rel=0.05)
    assert moe.read_params(1) == pytest.approx(moe.active_params, rel=1e-9)
    assert moe.read_params(1) < moe.read_params(8) < moe.read_params(64) < moe.matmul_params
    assert moe.read_params(1024) == pytest.approx(moe.matmul_params, rel=1e-6)
    m = RooflineCostModel(GPUS["h200"], moe)
    one, many = m.shape_time(decode(1, 128)), m.shape_time(decode(128, 128))
    dense = replace(moe, experts=0, intermediate=moe.experts * moe.expert_intermediate)   # the same bytes, all read
    assert one < 0.3 * RooflineCostModel(GPUS["h200"], dense).shape_time(decode(1, 128))
    assert one < many < 1.2 * RooflineCostModel(GPUS["h200"], dense).shape_time(decode(128, 128))
    assert m.flops(decode(64, 128)) < 0.2 * RooflineCostModel(GPUS["h200"], dense).flops(decode(64, 128))


def test_a_moe_config_json_gives_its_shape(tmp_path):
    import json

    for cfg, experts, width in (({"model_type": "qwen3_moe", "num_experts": 64, "num_experts_per_tok": 8,
                                  "moe_intermediate_size": 512, "intermediate_size": 3072}, 64, 512),
                                ({"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2,
                                  "intermediate_size": 1024}, 8, 1024)):
        (tmp_path / "config.json").write_text(json.dumps({
            "num_attention_heads": 8, "hidden_size": 512, "num_hidden_layers": 4, "vocab_size": 1000, **cfg}))
        shape = model_shape(str(tmp_path))
        assert (shape.experts, shape.expert_intermediate) == (experts, width)
        assert shape.active_params < shape.matmul_params
