"""LoRA over a GGUF-quantized base (Q8_0 blocks computed as stored, conveyor/model/quant.py): the
delta is added to the quantized kernels' output. With fp32 activations the kernels multiply exactly
the dequantized weights, so the logits equal peft's on the dequantized model; with int8
activations (the default on VNNI/AVX2 CPUs) they stay as close to it as the base does."""

from __future__ import annotations

import copy

import gguf
import gguf.quants
import numpy as np
import pytest
import torch

from conveyor.model.cpu_kernels import load_cpu_kernels
from conveyor.model.loader import build_model, read_config
from conveyor.model.quant import QuantLinear, QuantTensor
from conveyor.runner.model_runner import ModelRunner
from lora_testlib import ADAPTERS, VOCAB, PlanDriver, atol, load_peft, reference_logits

KERNELS = load_cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="C++ kernels not built here")
BS = 4


def quantized(hf: torch.nn.Module, int8: bool):
    """(the conveyor model with its projections in Q8_0 blocks, the HF model with those weights dequantized)."""
    kind = gguf.GGMLQuantizationType.Q8_0
    weights, dequantized = {}, copy.deepcopy(hf)
    for name, t in hf.state_dict().items():
        if name.endswith("proj.weight"):
            data = gguf.quants.quantize(t.numpy(), kind)
            weights[name] = QuantTensor(torch.from_numpy(np.ascontiguousarray(data)), "Q8_0", t.shape[1])
            dequantized.get_parameter(name).data.copy_(torch.from_numpy(gguf.quants.dequantize(data, kind)))
        else:
            weights[name] = t.clone()
    return weights, dequantized


@pytest.mark.parametrize("int8", [False, True])
def test_lora_on_a_quantized_base(worlds, int8):
    if int8 and not KERNELS.quant_int8_native():
        pytest.skip("no int8 kernel here")
    world = worlds("llama")
    weights, dequantized = quantized(world.hf, int8)
    model = build_model(read_config(world.root / "base"), weights, int8_activations=int8)
    assert all(isinstance(layer.self_attn.qkv_proj, QuantLinear) and layer.self_attn.qkv_proj.x16 == int8
               for layer in model.layers)
    refs = {spec.name: load_peft(dequantized, world.root / spec.name) for spec in ADAPTERS} | {None: dequantized}
    which = {"attn": "attn", "all": "all", "patterned": "patterned", "base": None}
    d = PlanDriver(ModelRunner(model, 64, BS, enable_lora=True), BS)
    g = torch.Generator().manual_seed(7)
    for rid, name in which.items():
        d.add(rid, torch.randint(0, VOCAB, (6,), generator=g).tolist(),
              None if name is None else world.loras[name])
    d.step([d.chunk(rid, 4) for rid in which])
    for step in range(4):   # the prompts' ends, then decodes
        d.step([d.chunk(rid) for rid in which])
        for rid, name in which.items():
            tokens = d.seqs[rid].tokens
            want = reference_logits(refs[name], tokens[:-1])[-1]
            got = d.logits(rid)
            if not int8:
                torch.testing.assert_close(got, want, rtol=0, atol=atol(want))
                assert tokens[-1] == int(want.argmax())
            else:   # int8 activations: 1e-3 of the scale, as the base model's own (tests/model/test_quant.py)
                assert (got - want).abs().max() <= 1e-3 * want.abs().max(), (rid, step)
                base = reference_logits(dequantized, tokens[:-1])[-1]
                assert name is None or (got - base).abs().max() > 100 * 1e-3 * want.abs().max()
            if int8 and tokens[-1] != int(want.argmax()):
                return   # (the contexts differ from here: nothing more to compare)

