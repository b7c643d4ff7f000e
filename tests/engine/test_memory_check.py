"""An engine refuses, before loading anything, a model whose weights plus the KV cache and swap
space asked for cannot fit in the memory available: a clear error, not the OOM killer mid-load."""

from __future__ import annotations

import pytest
import torch

import conveyor.engine.engine as engine_module
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine, available_memory
from conveyor.model.loader import ModelNotFoundError, demo_model_path, weight_bytes_estimate

GIB = 1 << 30


@pytest.fixture
def demo():
    try:
        return demo_model_path()
    except ModelNotFoundError as e:
        pytest.skip(str(e))


def test_the_estimate_is_the_file_as_stored_or_its_tensors_dequantized(demo):
    stored = weight_bytes_estimate(demo, torch.float32)
    assert stored == demo.stat().st_size
    dense = weight_bytes_estimate(demo, torch.float32, "none")
    assert dense > 4 * stored   # Q4_1 blocks -> fp32: ~6.4x
    assert weight_bytes_estimate(demo, torch.bfloat16, "none") * 2 == dense


def test_a_model_and_cache_that_cannot_fit_are_refused_before_loading(demo, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(engine_module, "load_model", no_load)
    monkeypatch.setattr(engine_module, "available_memory", lambda: 2 * GIB)
    config = EngineConfig(model=str(demo), dtype="float32", kv_cache_gib=4.0, swap_space_gib=0.5)
    with pytest.raises(ValueError, match=r"not enough memory .*KV cache \(4\.00 GiB\).*2\.0 GiB are available"):
        Engine(config)
    # What fits is not refused by the check (the load that follows is then reached).
    monkeypatch.setattr(engine_module, "available_memory", lambda: 8 * GIB)
    with pytest.raises(AssertionError, match="loaded"):
        Engine(config)


def test_available_memory_is_known_here():
    avail = available_memory()
    assert avail is None or avail > 0
