"""Session-scoped tiny random checkpoints of each supported family, saved and reloaded."""

from __future__ import annotations

import pytest
import torch

from model_testlib import FAMILIES, TinyFamily, load_family

_loaded: dict[str, TinyFamily] = {}


@pytest.fixture(scope="session", autouse=True)
def _torch_threads():
    # Tiny ops on a shared 2-core machine: a second intra-op thread only adds contention
    # (measured: this directory runs ~3x faster with 1 thread than with 2 under load).
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """``get(name)`` -> TinyFamily, built on first use and shared by the whole session."""
    def get(name: str) -> TinyFamily:
        if name not in _loaded:
            _loaded[name] = load_family(name, tmp_path_factory.mktemp(name))
        return _loaded[name]
    return get


@pytest.fixture(scope="session", params=sorted(FAMILIES))
def family(request, tiny_models) -> TinyFamily:
    return tiny_models(request.param)
