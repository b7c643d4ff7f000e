"""Session-scoped tiny bases with random PEFT adapters (and peft's models of them, the reference)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conveyor.lora.request import LoRARequest
from conveyor.model.llama import LlamaForCausalLM as ConveyorModel
from lora_testlib import ADAPTERS, conveyor_model, make_hf_base, write_adapter


@pytest.fixture(scope="session", autouse=True)
def _torch_threads():
    prev = torch.get_num_threads()   # tiny ops on a shared 2-core machine: one thread
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@dataclass
class World:
    hf: torch.nn.Module                 # the base model (transformers)
    model: ConveyorModel                # the same weights, built as the engine builds them
    loras: dict[str, LoRARequest]       # adapter name -> what a request brings
    peft: dict[str, torch.nn.Module]    # adapter name -> peft's model of base + adapter
    root: Path


_worlds: dict[str, World] = {}


@pytest.fixture(scope="session")
def worlds(tmp_path_factory):
    """``get(family)`` -> World, built on first use and shared by the session."""
    def get(family: str) -> World:
        if family not in _worlds:
            root = tmp_path_factory.mktemp(f"lora-{family}")
            hf = make_hf_base(family)
            model = conveyor_model(hf, root / "base")
            loras, peft = {}, {}
            for i, spec in enumerate(ADAPTERS):
                peft[spec.name] = write_adapter(hf, root / spec.name, spec, seed=i + 1)
                loras[spec.name] = LoRARequest(spec.name, i + 1, str(root / spec.name))
            _worlds[family] = World(hf, model, loras, peft, root)
        return _worlds[family]
    return get
