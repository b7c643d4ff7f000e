"""Several LoRA adapters and the base model in one step, through the ModelRunner: each request's
logits equal peft's model of its adapter (fp32), through prefill chunks, decodes, mixed steps and
speculative drafts; adapters evicted and read again give the same bits; what cannot be served is
refused by name."""

from __future__ import annotations

import pytest
import torch

from conveyor.engine.engine import EngineBackend, EngineConfig
from conveyor.lora.manager import LoRASlotsError
from conveyor.lora.peft_config import LoRAAdapterError
from conveyor.lora.request import LoRARequest
from conveyor.runner.model_runner import ModelRunner
from lora_testlib import VOCAB, PlanDriver, atol, reference_logits

BS = 4


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def check(world, d: PlanDriver, which: dict[str, str | None], rids) -> None:
    """Each sampled request's latest logits row and token against its reference (peft, or the base)."""
    for rid in rids:
        tokens = d.seqs[rid].tokens
        ref_model = world.hf if which[rid] is None else world.peft[which[rid]]
        want = reference_logits(ref_model, tokens[:-1])[-1]
        got = d.logits(rid)
        torch.testing.assert_close(got, want, rtol=0, atol=atol(want), msg=lambda m: f"{rid}: {m}")
        assert tokens[-1] == int(want.argmax()), rid


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_mixed_adapters_and_base_match_peft(worlds, family):
    world = worlds(family)
    # two requests under "attn" (their rows apart: a gather), one under each other adapter, one on the base
    which = {"a1": "attn", "b": "all", "base": None, "p": "patterned", "a2": "attn", "late": "all"}
    d = PlanDriver(ModelRunner(world.model, 96, BS, enable_lora=True), BS)
    for rid, p in zip(which, prompts(9, 6, 7, 11, 5, 8)):
        d.add(rid, p, None if which[rid] is None else world.loras[which[rid]])
    # The adapters change the model: their references are far from the base's.
    for name, model in world.peft.items():
        tokens = d.seqs["p"].tokens
        assert (reference_logits(model, tokens) - reference_logits(world.hf, tokens)).abs().max() > 0.1, name

    d.step([d.chunk("a1", 5), d.chunk("b", 6), d.chunk("base", 3), d.chunk("p", 4), d.chunk("a2", 2)])
    check(world, d, which, ["b"])
    d.step([d.chunk("b"), d.chunk("a1"), d.chunk("base"), d.chunk("p", 3), d.chunk("a2")])
    check(world, d, which, ["a1", "b", "base", "a2"])
    d.step([d.chunk("late", 3), d.chunk("p"), d.chunk("a2"), d.chunk("b"), d.chunk("a1"), d.chunk("base")])
    check(world, d, which, ["p", "a2", "b", "a1", "base"])
    for _ in range(4):   # decodes, with the last request's prompt chunks at first
        d.step([d.chunk(rid) if rid != "late" else d.chunk(rid, 3) for rid in which])
        check(world, d, which, [rid for rid in which if rid != "late" or d.seqs[rid].computed >= 8])


@pytest.mark.parametrize("kernel", [True, False])
def test_small_steps_on_the_kernel_and_on_torch_ops(worlds, kernel):
    """Steps with several adapters go to the C++ kernel (one call per matmul), unless it is off (the
    grouped torch ops); both equal peft."""
    from conveyor.model.cpu_kernels import cpu_kernels

    world = worlds("llama")
    if kernel and cpu_kernels("cpu", torch.float32) is None:
        pytest.skip("the C++ kernels are unavailable here")
    runner = ModelRunner(world.model, 96, BS, enable_lora=True)
    runner.loras.kernel = kernel
    which = {"a": "attn", "base": None, "b": "all", "p": "patterned", "a2": "attn"}
    d = PlanDriver(runner, BS)
    for rid, p in zip(which, prompts(6, 5, 7, 4, 6, seed=3)):
        d.add(rid, p, None if which[rid] is None else world.loras[which[rid]])
    batches = []
    lora_batch = runner._lora_batch
    runner._lora_batch = lambda plan, inputs: batches.append(lora_batch(plan, inputs)) or batches[-1]
    for _ in range(4):
        d.step([d.chunk(rid) for rid in which])
        check(world, d, which, list(which))
    assert batches and all((b.order is not None) == kernel for b in batches)


def peft_greedy(model, tokens: list[int], n: int) -> list[int]:
    tokens = list(tokens)
    for _ in range(n):
        tokens.append(int(reference_logits(model, tokens)[-1].argmax()))
    return tokens[-n:]


def test_speculative_drafts_run_under_their_adapter(worlds):
    """Drafts are extra rows of their request: verified with its adapter's logits."""
    world = worlds("llama")
    which = {"lo": "all", "base": None}
    d = PlanDriver(ModelRunner(world.model, 64, BS, enable_lora=True), BS)
    for rid, p in zip(which, prompts(7, 6, seed=1)):
        d.add(rid, p, world.loras["all"] if which[rid] else None)
    d.step([d.chunk(rid) for rid in which])
    drafts = {}
    for rid in which:
        ref = world.peft["all"] if which[rid] else world.hf
        good = peft_greedy(ref, d.seqs[rid].tokens, 3)
        drafts[rid] = good[:2] + [(good[2] + 1) % VOCAB]   # two right, the third wrong
    out = d.step([d.chunk(rid, drafts=drafts[rid]) for rid in which])
    for rid in which:
        assert out.num_accepted(rid) == 2, rid
    check(world, d, which, list(which))
    d.step([d.chunk(rid) for rid in which])   # the next chunk starts after the accepted drafts
    check(world, d, which, list(which))


def test_only_steps_without_lora_rows_take_the_fused_decode_loop(worlds, monkeypatch):
    world = worlds("llama")
    model = world.model
    if not model.fused_decode_tokens:
        pytest.skip("no fused decode loop here (C++ kernels not built)")
    calls = []
    fused = model._fused_decode
    monkeypatch.setattr(model, "_fused_decode", lambda *a: calls.append(1) or fused(*a))
    which = {"lo": "attn", "base": None}
    d = PlanDriver(ModelRunner(model, 64, BS, enable_lora=True), BS)
    for rid, p in zip(which, prompts(5, 6, seed=2)):
        d.add(rid, p, world.loras["attn"] if which[rid] else None)
    d.step([d.chunk(rid) for rid in which])
    d.step([d.chunk("base")])
    assert calls == [1]   # a decode step of the base model only: the fused loop, as without LoRA
    d.step([d.chunk("base"), d.chunk("lo")])
    assert calls == [1]
    check(world, d, which, list(which))


def run_alone(world, runner: ModelRunner, d: PlanDriver, rid: str, prompt: list[int], lora: LoRARequest,
              forget: list[str]) -> list[torch.Tensor]:
    d.add(rid, prompt, lora)
    d.step([d.chunk(rid)], forget=forget)
    rows = [d.logits(rid).clone()]
    for _ in range(2):
        d.step([d.chunk(rid)])
        rows.append(d.logits(rid).clone())
    return rows


def test_an_adapter_evicted_and_read_again_gives_the_same_logits(worlds):
    world = worlds("llama")
    runner = ModelRunner(world.model, 64, BS, enable_lora=True, max_loras=2)
    manager = runner.loras.manager
    d = PlanDriver(runner, BS)
    attn = world.loras["attn"]
    p = prompts(6, seed=3)[0]
    first = run_alone(world, runner, d, "r1", p, attn, [])
    d.add("r2", prompts(4, seed=4)[0], world.loras["all"])
    d.add("r3", prompts(5, seed=5)[0], world.loras["patterned"])
    d.step([d.chunk("r2"), d.chunk("r3")], forget=["r1"])   # two slots: "attn" (idle) goes
    assert [lora.lora_name for lora in runner.list_loras()] == ["all", "patterned"] and manager.num_loads == 3
    again = run_alone(world, runner, d, "r4", p, attn, ["r2", "r3"])
    assert manager.num_loads == 4
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    check(world, d, {"r4": "attn"}, ["r4"])


def test_add_list_and_remove_adapters(worlds):
    world = worlds("llama")
    runner = ModelRunner(world.model, 32, BS, enable_lora=True, max_loras=2)
    runner.add_lora(world.loras["attn"])
    runner.add_lora(world.loras["all"])
    assert [lora.lora_name for lora in runner.list_loras()] == ["attn", "all"]
    assert runner.remove_lora("attn") and not runner.remove_lora("attn")
    assert runner.remove_lora(world.loras["all"].lora_int_id)
    assert runner.list_loras() == []
    # a request under a removed adapter reads it again
    d = PlanDriver(runner, BS)
    d.add("r", prompts(5, seed=6)[0], world.loras["attn"])
    d.step([d.chunk("r")])
    check(world, d, {"r": "attn"}, ["r"])
    assert runner.loras.manager.num_loads == 3


def test_more_adapters_in_one_step_than_slots_is_refused(worlds):
    world = worlds("llama")
    d = PlanDriver(ModelRunner(world.model, 32, BS, enable_lora=True, max_loras=2), BS)
    for i, (name, lora) in enumerate(world.loras.items()):
        d.add(name, prompts(3, seed=i)[0], lora)
    with pytest.raises(LoRASlotsError, match="3 LoRA adapters in one step, above max_loras 2"):
        d.step([d.chunk(name) for name in world.loras])


def test_a_refused_adapter_fails_the_step_and_evicts_nothing(worlds):
    world = worlds("llama")
    runner = ModelRunner(world.model, 32, BS, enable_lora=True, max_loras=1, max_lora_rank=4)
    runner.add_lora(world.loras["attn"])
    d = PlanDriver(runner, BS)
    d.add("r", prompts(3)[0], world.loras["all"])   # rank 8
    with pytest.raises(LoRAAdapterError, match="'all'.*rank 8 exceeds max_lora_rank 4"):
        d.step([d.chunk("r")])
    assert [lora.lora_name for lora in runner.list_loras()] == ["attn"]


def test_lora_requests_are_refused_when_lora_is_off(worlds):
    world = worlds("llama")
    runner = ModelRunner(world.model, 32, BS)
    d = PlanDriver(runner, BS)
    d.add("r", prompts(3)[0], world.loras["attn"])
    with pytest.raises(ValueError, match="'r' asks for LoRA adapter 'attn'.*enable_lora is off"):
        d.step([d.chunk("r")])
    with pytest.raises(ValueError, match="enable_lora is off"):
        runner.add_lora(world.loras["attn"])
    assert runner.list_loras() == [] and not runner.remove_lora("attn")


def test_engine_refuses_lora_with_tensor_parallelism(worlds):
    world = worlds("llama")
    with pytest.raises(ValueError, match="enable_lora is not supported with tensor_parallel_size > 1"):
        EngineBackend(EngineConfig(model=str(world.root / "base"), enable_lora=True, tensor_parallel_size=2))
