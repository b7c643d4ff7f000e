"""The same command gives the same engine: probe-chosen paths are measured once per machine and
remembered; dtype="auto" follows the CPU's features, and a flickering probe cannot flip it."""

from __future__ import annotations

import json
import os

import pytest

from conveyor.model import dtype as dtype_mod, probe_cache
from conveyor.model.dtype import cpu_auto_dtype


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CONVEYOR_PROBES_DIR", raising=False)   # (the suite's own: tests/conftest.py)
    monkeypatch.delenv("CONVEYOR_PROBES", raising=False)
    monkeypatch.setattr(probe_cache, "_fresh_done", set())
    return tmp_path


def test_a_probe_is_measured_once_and_read_back():
    calls = []
    assert probe_cache.remembered("x", lambda: calls.append(1) or 7) == 7
    assert probe_cache.remembered("x", lambda: calls.append(1) or 9) == 7     # a later start: the same answer
    assert calls == [1]
    data = json.loads(probe_cache.probes_path().read_text())
    assert data["decisions"] == {"x": 7} and data["machine"] == probe_cache.machine_key()


def test_fresh_measures_again_once_and_off_never_touches_the_file(monkeypatch):
    probe_cache.remembered("x", lambda: 1)
    monkeypatch.setenv("CONVEYOR_PROBES", "fresh")
    assert probe_cache.remembered("x", lambda: 2) == 2
    assert probe_cache.remembered("x", lambda: 3) == 2      # once per process
    monkeypatch.setenv("CONVEYOR_PROBES", "off")
    assert probe_cache.remembered("x", lambda: 4) == 4
    assert probe_cache.remembered("y", lambda: 5) == 5
    assert json.loads(probe_cache.probes_path().read_text())["decisions"] == {"x": 2}


def test_another_machine_key_measures_afresh(monkeypatch):
    probe_cache.remembered("x", lambda: 1)
    first = probe_cache.probes_path()
    monkeypatch.setattr(probe_cache, "cpu_info", lambda: ("Another CPU", {"avx2"}))
    assert probe_cache.probes_path() != first
    assert probe_cache.remembered("x", lambda: 2) == 2


def test_auto_dtype_without_native_bf16_is_fp32_without_a_probe(monkeypatch):
    monkeypatch.setattr(dtype_mod, "bf16_speedup_on_cpu", lambda: pytest.fail("no probe without native bf16"))
    assert cpu_auto_dtype({"avx2", "avx512f", "avx512_vnni"})[0] == "float32"


def test_auto_dtype_cannot_flip_between_starts_on_a_busy_machine(monkeypatch):
    """The reported case: one start measured bf16 at 4.4x fp32, a busy one 0.28x. With native bf16
    flags the first answer is remembered, so every later start chooses the same dtype."""
    flags = {"avx512f", "avx512_bf16"}
    measurements = iter([4.4, 0.28, 0.28])
    monkeypatch.setattr(dtype_mod, "bf16_speedup_on_cpu", lambda: next(measurements))
    choices = {cpu_auto_dtype(flags)[0] for _ in range(3)}
    assert choices == {"bfloat16"}


def test_a_trapping_hypervisor_vetoes_bf16(monkeypatch):
    monkeypatch.setattr(dtype_mod, "bf16_speedup_on_cpu", lambda: 0.2)
    chosen, why = cpu_auto_dtype({"amx_bf16", "amx_tile"})
    assert chosen == "float32" and "0.20x" in why
    # a moderate slowdown (noise on a shared machine) is not a veto
    monkeypatch.setenv("CONVEYOR_PROBES", "off")
    monkeypatch.setattr(dtype_mod, "bf16_speedup_on_cpu", lambda: 0.8)
    assert cpu_auto_dtype({"amx_bf16"})[0] == "bfloat16"


def test_linear_path_probes_are_remembered(monkeypatch):
    """The GEMV width and the prepacking decision come back from the file, not a new timing."""
    from conveyor.model import linear

    import torch

    linear._measured.cache_clear()
    name = f"packed_linear/{torch.float32}/64x96"
    probe_cache.remembered(name, lambda: True)
    monkeypatch.setattr(linear, "_measure_packed", lambda *a: pytest.fail("measured again"))
    assert linear._measured(torch.float32, 64, 96) is True
    linear._measured.cache_clear()


def test_processes_starting_together_share_the_first_measurement(tmp_path):
    """Replicas of one server start at once: under the file lock the first measures, the others
    read its answer (each would otherwise time its own, and they could differ)."""
    import subprocess
    import sys

    code = ("import os, time; from conveyor.model import probe_cache as p; "
            "print(p.remembered('race', lambda: (time.sleep(0.5), os.getpid())[1]))")
    env = {**os.environ, "CONVEYOR_CACHE_DIR": str(tmp_path)}
    env.pop("CONVEYOR_PROBES_DIR", None)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(3)]
    answers = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert len(answers) == 1 and answers != {""}


def test_gemv_threshold_survives_one_noisy_count(monkeypatch):
    """Every token count is measured; a tie goes to the GEMV (its fused layer loop saves more than
    the margin), and one count losing in the middle does not cut the threshold short."""
    from conveyor.model import linear

    import torch

    from conveyor.model.cpu_kernels import cpu_kernels

    if cpu_kernels("cpu", torch.float32) is None:
        pytest.skip("C++ kernels not built here")
    ratios = iter([0.8, 1.3, 1.05, 1.1, 0.9, 1.2, 1.4, 1.6])   # counts 1..8 (2 noisy; 6-8 clearly slower)
    monkeypatch.setattr(linear, "_ratio", lambda a, b: next(ratios))
    assert linear._measure_gemv(torch.float32, 64, 96, packed=False, copies=2) == 5


def test_prepacking_is_chosen_per_shape_and_only_when_clearly_faster(monkeypatch):
    """Each weight shape gets its own decision, made at the token counts prepacked weights serve
    (not at one token, where the GEMV runs), with a margin."""
    from conveyor.model import linear

    import torch

    if not linear._ops_available():
        pytest.skip("no oneDNN linear ops in this torch")
    seen = []

    def fake_ratio(a, b):
        a()   # the packed side: one call per token count
        seen.append(len(a()))
        return 0.96
    monkeypatch.setattr(linear, "_ratio", fake_ratio)
    assert linear._measure_packed(torch.float32, 64, 96) is False           # 4% faster: within the margin
    monkeypatch.setattr(linear, "_ratio", lambda a, b: 0.5)
    assert linear._measure_packed(torch.float32, 64, 96) is True
    assert seen == [len(linear.PACKED_PROBE_TOKENS)]


def test_model_takes_prepacking_per_shape(tiny_models, monkeypatch):
    from conveyor.model import linear, loader

    import torch

    if not linear._ops_available():
        pytest.skip("no oneDNN linear ops in this torch")
    fam = tiny_models("llama_gqa")
    cfg = fam.cfg
    qkv = (cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size)
    asked = []
    monkeypatch.setattr(linear, "prefer_packed", lambda device, dtype, k, n: asked.append((k, n)) or (k, n) == qkv)
    monkeypatch.setenv("CONVEYOR_GEMV", "off")
    model = loader.build_model(cfg, loader.load_weights(fam.path), dtype=torch.float32)
    layer = model.layers[0]
    assert layer.self_attn.qkv_proj.packed is not None and layer.self_attn.o_proj.packed is None
    assert layer.mlp.gate_up_proj.packed is None and model.cpu_lm_head.packed is None
    assert (cfg.hidden_size, cfg.vocab_size) in asked and len(set(asked)) == len(asked) >= 4


def test_restricted_cpu_flags_build_and_choose_as_on_the_lesser_cpu(monkeypatch):
    """CONVEYOR_CPU_FLAGS keeps only the named flags of the CPU's (never adds one): the kernels are
    then built for those (a module of their own) and every feature-based choice follows, e.g. no
    AVX512-BF16 -> dtype "auto" is fp32, and the probes are remembered under another machine key."""
    from conveyor.model import cpu_kernels

    model, flags = probe_cache.cpu_info()
    key = probe_cache.machine_key()
    monkeypatch.setenv("CONVEYOR_CPU_FLAGS", "avx2, fma f16c no_such_flag")
    assert probe_cache.cpu_info() == (model, flags & {"avx2", "fma", "f16c"})
    assert set(cpu_kernels._cpu_flags()) == {f"-m{f}" for f in flags & {"avx2", "fma", "f16c"}}
    assert cpu_kernels._module_name(cpu_kernels._cpu_flags()).startswith("conveyor_cpu_kernels_")
    assert cpu_auto_dtype(dtype_mod.cpu_flags())[0] == "float32"
    if flags - {"avx2", "fma", "f16c"}:
        assert probe_cache.machine_key() != key
    monkeypatch.delenv("CONVEYOR_CPU_FLAGS")
    assert cpu_kernels._module_name(cpu_kernels._cpu_flags()) == "conveyor_cpu_kernels"
