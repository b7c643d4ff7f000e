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
