"""A GGUF's quantized matmuls cached in the kernels' layout and memory-mapped (conveyor/model/packed.py):
the first load writes the cache and maps it, later loads map it without reading the GGUF's blocks,
and every load computes the same logits as without the cache; a changed file or a damaged cache is
never read."""

from __future__ import annotations

import os

import pytest
import torch

from conveyor.model import gguf_loader
from conveyor.model.loader import demo_model_path, load_model
from conveyor.model.quant import QuantEmbedding, QuantLinear
from model_testlib import conveyor_prompt_logits, random_prompts
from test_quant import KERNELS, _tiny_quantized_gguf

pytestmark = pytest.mark.skipif(KERNELS is None or not KERNELS.quant_int8_native(),
                                reason="the int8 kernel (its layout is what is cached) does not run here")
PROMPTS = random_prompts([1, 9, 40], seed=7)


def _mapped_from(model, file) -> bool:
    """Whether every quantized matmul's tensor lies in a mapping of `file` (not a copy in memory)."""
    spans = []
    for line in open("/proc/self/maps").read().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(file):
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            spans.append((lo, hi))
    held = [m.qweight for m in model.modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
    return bool(held) and all(any(lo <= t.data_ptr() < hi for lo, hi in spans) for t in held)


def _load(path, dtype=torch.float32):
    """(The tiny files have no tokenizer: the demo model's.)"""
    return load_model(path, dtype=dtype, tokenizer=demo_model_path()).model


def _files(cache) -> list:
    return sorted((cache / "packed").glob("*.safetensors"))


@pytest.mark.parametrize("name, arch, qtype, dtype", [("llama_gqa", "llama", "Q4_1", torch.float32),
                                                      ("llama_tied", "llama", "Q8_0", torch.bfloat16)])
def test_a_gguf_is_packed_once_then_mapped_with_the_same_logits(tiny_models, tmp_path, monkeypatch, name, arch,
                                                                  qtype, dtype):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    path = _tiny_quantized_gguf(tiny_models(name).hf, tmp_path / f"{name}.gguf", arch, qtype)
    monkeypatch.setenv("CONVEYOR_PACKED_WEIGHTS", "off")
    plain = _load(path, dtype)
    assert not (tmp_path / "cache" / "packed").exists()
    want = conveyor_prompt_logits(plain, PROMPTS, chunk=16)
    monkeypatch.delenv("CONVEYOR_PACKED_WEIGHTS")

    first = _load(path, dtype)   # a miss: packed, written, then mapped
    [file] = _files(tmp_path / "cache")
    assert _mapped_from(first, file)
    assert first.weight_bytes() == plain.weight_bytes()
    written = file.stat().st_mtime_ns

    read = []   # a hit: the GGUF's quantized blocks are not read at all
    real = gguf_loader.gguf_tensors
    monkeypatch.setattr(gguf_loader, "gguf_tensors", lambda *a, **k: read.append(real(*a, **k)) or read[-1])
    second = _load(path, dtype)
    assert read and not any(k.endswith("proj.weight") for k in read[-1])
    assert _files(tmp_path / "cache") == [file] and file.stat().st_mtime_ns == written
    assert _mapped_from(second, file)
    for model in (first, second):
        for got, exp in zip(conveyor_prompt_logits(model, PROMPTS, chunk=16), want):
            assert torch.equal(got, exp)


def test_a_changed_file_or_a_damaged_cache_is_not_read(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    path = _tiny_quantized_gguf(tiny_models("llama_gqa").hf, tmp_path / "m.gguf", "llama", "Q4_0")
    want = conveyor_prompt_logits(_load(path), PROMPTS, chunk=16)
    [old] = _files(tmp_path / "cache")

    data = path.read_bytes()   # the same name, new contents: a new key, and the old cache goes
    path.write_bytes(data[:-32] + bytes(32))
    os.utime(path, ns=(1, 1))
    _load(path)
    [new] = _files(tmp_path / "cache")
    assert new != old and not old.with_suffix(".lock").exists()

    path.write_bytes(data)   # back to the first contents, then a cache cut short
    os.utime(path, ns=(2, 2))
    _load(path)
    [file] = _files(tmp_path / "cache")
    file.write_bytes(file.read_bytes()[:1000])
    model = _load(path)   # read from the GGUF again and packed again
    [again] = _files(tmp_path / "cache")
    assert again.stat().st_size > 1000 and _mapped_from(model, again)
    for got, exp in zip(conveyor_prompt_logits(model, PROMPTS, chunk=16), want):
        assert torch.equal(got, exp)



def test_a_cache_that_cannot_be_written_leaves_the_weights_in_memory(tiny_models, tmp_path, monkeypatch):
    """A full or read-only disk: the load goes on with the weights in private memory."""
    import safetensors.torch

    cache = tmp_path / "cache"
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(cache))
    path = _tiny_quantized_gguf(tiny_models("llama_gqa").hf, tmp_path / "m.gguf", "llama", "Q8_0")

    def full(tensors, filename, metadata=None):
        open(filename, "wb").write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    model = _load(path)
    assert not _files(cache) and not list((cache / "packed").glob("*.tmp*"))
    monkeypatch.undo()
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(cache))
    want = conveyor_prompt_logits(_load(path), PROMPTS, chunk=16)   # now written and mapped
    [file] = _files(cache)
    assert not _mapped_from(model, file)
    for got, exp in zip(conveyor_prompt_logits(model, PROMPTS, chunk=16), want):
        assert torch.equal(got, exp)
