"""PEFT adapters read into tensors (conveyor/lora/adapter.py, peft_config.py): ranks, scales and
patterns as peft applies them; everything not served refused with the adapter's name and why.
And the resident set (conveyor/lora/manager.py): LRU, idle adapters first, a step's own never."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conveyor.lora.adapter import read_adapter
from conveyor.lora.manager import LoRAManager, LoRASlotsError
from conveyor.lora.peft_config import LoRAAdapterError
from conveyor.lora.request import LoRARequest
from conveyor.model.lora import base_shapes
from lora_testlib import AdapterSpec, make_hf_base, write_adapter

KEY = "base_model.model.model.layers.{}.{}.lora_{}.weight"


def test_weights_layers_and_scales_are_peft_s(worlds):
    world = worlds("llama")
    base = base_shapes(world.model.cfg)
    raw = {name: load_file(f"{lora.lora_path}/adapter_model.safetensors") for name, lora in world.loras.items()}

    attn = read_adapter(world.loras["attn"], base, 64)
    assert attn.rank == 4 and [sorted(layer) for layer in attn.layers] == [["o_proj", "q_proj", "v_proj"]] * 2
    w = attn.layers[1]["v_proj"]
    assert torch.equal(w.a, raw["attn"][KEY.format(1, "self_attn.v_proj", "A")])
    torch.testing.assert_close(w.b, raw["attn"][KEY.format(1, "self_attn.v_proj", "B")] * (8 / 4), rtol=0, atol=0)

    every = read_adapter(world.loras["all"], base, 64)   # "all-linear", rsLoRA: alpha / sqrt(r)
    assert all(len(layer) == 7 for layer in every.layers)
    torch.testing.assert_close(every.layers[0]["down_proj"].b,
                               raw["all"][KEY.format(0, "mlp.down_proj", "B")] * (16 / math.sqrt(8)), rtol=0, atol=0)

    patterned = read_adapter(world.loras["patterned"], base, 64)   # layer 1 only; down_proj rank 6; k_proj alpha 1
    assert patterned.layers[0] == {} and patterned.rank == 6
    layer = patterned.layers[1]
    assert layer["down_proj"].a.shape == (6, 64) and layer["gate_proj"].a.shape == (2, 32)
    torch.testing.assert_close(layer["down_proj"].b, raw["patterned"][KEY.format(1, "mlp.down_proj", "B")] * (4 / 6),
                               rtol=0, atol=0)
    torch.testing.assert_close(layer["k_proj"].b, raw["patterned"][KEY.format(1, "self_attn.k_proj", "B")] * (1 / 2),
                               rtol=0, atol=0)
    assert read_adapter(world.loras["attn"], base, 64, torch.bfloat16).layers[0]["q_proj"].a.dtype == torch.bfloat16


def _edited(src, dst, config=None, weights=None):
    """A copy of adapter `src` with its config updated by `config` and its weights by `weights` (None: drop)."""
    shutil.copytree(src, dst)
    if config:
        c = json.loads((dst / "adapter_config.json").read_text())
        c.update(config)
        (dst / "adapter_config.json").write_text(json.dumps(c))
    if weights:
        w = load_file(dst / "adapter_model.safetensors")
        for k, v in weights.items():
            if v is None:
                del w[k]
            else:
                w[k] = v
        save_file(w, dst / "adapter_model.safetensors")
    return dst


CONFIG_CASES = {
    "dora": ({"use_dora": True}, "DoRA"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    "bias": ({"bias": "lora_only"}, "bias='lora_only'"),
    "lora_bias": ({"lora_bias": True}, "lora_bias"),
    "lm_head": ({"target_modules": ["q_proj", "lm_head"]}, "the LM head"),
    "embedding_regex": ({"target_modules": r".*(embed_tokens|q_proj)"}, "the token embedding"),
    "unknown_target": ({"target_modules": ["q_proj", "c_attn"]}, "'c_attn'"),
    "rank": ({"r": 128}, "rank 128 exceeds max_lora_rank 64"),
    "rank_pattern": ({"rank_pattern": {"q_proj": 100}}, "rank 100 exceeds max_lora_rank 64"),
    "rank_mismatch": ({"r": 5}, "has rank 4, its config says 5"),
    "other_peft_type": ({"peft_type": "IA3"}, "peft_type 'IA3' is not LORA"),
    "variant": ({"alora_invocation_tokens": [1, 2]}, "activated LoRA"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_unsupported_configs_are_refused(worlds, tmp_path, case):
    world = worlds("llama")
    config, message = CONFIG_CASES[case]
    path = _edited(world.root / "attn", tmp_path / case, config=config)
    with pytest.raises(LoRAAdapterError, match=f"LoRA adapter 'bad': .*{_re(message)}"):
        read_adapter(LoRARequest("bad", 9, str(path)), base_shapes(world.model.cfg), 64)


def _re(text: str) -> str:
    import re
    return re.escape(text)


def test_unsupported_weights_are_refused(worlds, tmp_path):
    world = worlds("llama")
    base = base_shapes(world.model.cfg)
    src = world.root / "attn"
    q_a = KEY.format(0, "self_attn.q_proj", "A")
    cases = {
        "lm_head": ({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 32)}, "'base_model.model.lm_head.lora_A"
                                                                                    ".weight' is not a LoRA A/B"),
        "embedding": ({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 128)},
                      "embed_tokens.lora_embedding_A"),
        "dora_magnitude": ({"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": torch.ones(32)},
                           "lora_magnitude_vector"),
        "layer": ({KEY.format(7, "self_attn.q_proj", "A"): torch.zeros(4, 32),
                   KEY.format(7, "self_attn.q_proj", "B"): torch.zeros(32, 4)}, "layer 7; the base model has 2"),
        "shape": ({q_a: torch.zeros(4, 48)}, "do not fit the base model's projection (32 -> 32 features)"),
        "missing_b": ({KEY.format(0, "self_attn.q_proj", "B"): None}, "lora_A without its lora_B"),
        "wrong_parent": ({KEY.format(0, "mlp.q_proj", "A"): torch.zeros(4, 32)}, "adapts mlp.q_proj"),
    }
    for case, (weights, message) in cases.items():
        path = _edited(src, tmp_path / case, weights=weights)
        with pytest.raises(LoRAAdapterError, match=f"LoRA adapter 'bad': .*{_re(message)}"):
            read_adapter(LoRARequest("bad", 9, str(path)), base, 64)


def test_missing_and_unreadable_files_are_refused(worlds, tmp_path):
    world = worlds("llama")
    base = base_shapes(world.model.cfg)
    with pytest.raises(LoRAAdapterError, match="no adapter_config.json in .*not a PEFT adapter directory"):
        read_adapter(LoRARequest("gone", 1, str(tmp_path / "nowhere")), base, 64)
    binary = _edited(world.root / "attn", tmp_path / "bin")
    (binary / "adapter_model.safetensors").rename(binary / "adapter_model.bin")
    with pytest.raises(LoRAAdapterError, match="found adapter_model.bin: only safetensors adapters are read"):
        read_adapter(LoRARequest("bin", 1, str(binary)), base, 64)
    broken = _edited(world.root / "attn", tmp_path / "broken")
    (broken / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(LoRAAdapterError, match="'broken': cannot read"):
        read_adapter(LoRARequest("broken", 1, str(broken)), base, 64)
    (broken / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAAdapterError, match="'broken': cannot read"):
        read_adapter(LoRARequest("broken", 1, str(broken)), base, 64)


@pytest.mark.filterwarnings("ignore:Setting .save_embedding_layers.")
@pytest.mark.parametrize("spec, message", [
    (AdapterSpec("dora", 4, 8, ["q_proj"], extra=dict(use_dora=True)), "DoRA"),
    (AdapterSpec("head", 4, 8, ["q_proj", "lm_head"]), "the LM head"),
    (AdapterSpec("embed", 4, 8, ["q_proj", "embed_tokens"]), "the token embedding"),
])
def test_adapters_peft_writes_for_unsupported_targets_are_refused(worlds, tmp_path, spec, message):
    world = worlds("llama")
    write_adapter(world.hf, tmp_path / spec.name, spec, seed=0)
    with pytest.raises(LoRAAdapterError, match=f"'{spec.name}': .*{_re(message)}"):
        read_adapter(LoRARequest(spec.name, 1, str(tmp_path / spec.name)), base_shapes(world.model.cfg), 64)


def test_an_adapter_of_another_model_is_refused(worlds, tmp_path):
    world = worlds("llama")
    other = make_hf_base("llama", intermediate_size=96)
    write_adapter(other, tmp_path / "other", AdapterSpec("other", 4, 8, ["down_proj"]), seed=0)
    with pytest.raises(LoRAAdapterError, match=r"'other': .*down_proj: lora_A \(4, 96\) .* do not fit"):
        read_adapter(LoRARequest("other", 1, str(tmp_path / "other")), base_shapes(world.model.cfg), 64)


# ---- the resident set -------------------------------------------------------------------------


def lora(i: int, name: str | None = None) -> LoRARequest:
    return LoRARequest(name or f"l{i}", i, f"/adapters/{i}")


class Loads:
    def __init__(self):
        self.read: list[int] = []
        self.live: set[int] = set()

    def __call__(self, req: LoRARequest):
        if req.lora_path.endswith("bad"):
            raise LoRAAdapterError("refused")
        self.read.append(req.lora_int_id)
        return f"weights {req.lora_int_id}"


def test_manager_evicts_the_least_recently_used_idle_adapter_first():
    loads = Loads()
    m = LoRAManager(3, loads, lambda: loads.live)
    assert m.acquire([lora(1), lora(2)]) == ["weights 1", "weights 2"]
    m.acquire([lora(3)])
    m.acquire([lora(1)])                  # a hit: 1 is now the most recently used
    assert loads.read == [1, 2, 3] and [r.lora_int_id for r in m.resident()] == [2, 3, 1]
    loads.live = {2}                      # a live request runs under 2: the idle 3 goes, not 2
    m.acquire([lora(4)])
    assert [r.lora_int_id for r in m.resident()] == [2, 1, 4]
    loads.live = {2, 1, 4}                # all live: the least recently used one not in the step
    m.acquire([lora(2), lora(5)])
    assert [r.lora_int_id for r in m.resident()] == [4, 2, 5]
    m.acquire([lora(1)])                  # read again (its request runs again): the idle 5 goes
    assert loads.read == [1, 2, 3, 4, 5, 1] and [r.lora_int_id for r in m.resident()] == [4, 2, 1]


def test_manager_refusals():
    loads = Loads()
    m = LoRAManager(2, loads)
    with pytest.raises(LoRASlotsError, match="3 LoRA adapters in one step, above max_loras 2"):
        m.acquire([lora(1), lora(2), lora(3)])
    m.acquire([lora(1), lora(2)])
    with pytest.raises(LoRAAdapterError):
        m.acquire([LoRARequest("x", 3, "/adapters/bad")])
    assert [r.lora_int_id for r in m.resident()] == [1, 2]   # a refused adapter evicted nothing
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter 'l1'.*not 'other'.*remove it first"):
        m.acquire([LoRARequest("other", 1, "/adapters/other")])
    assert m.remove("l1") and not m.remove("l1") and m.remove(2) and len(m) == 0
