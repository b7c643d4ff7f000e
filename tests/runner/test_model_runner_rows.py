"""The model runner names every result by request id: its logit rows follow the model's layout
(prefill chunks first, then decodes by context length, longest first), which is not the plan's
order, and nothing is permuted back. Each request of a mixed batch, in a deliberately shuffled
plan order, must get what it gets alone: its token, its logprobs (with the sampled token's exact
rank), its structured-output mask."""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.model.attention import make_attention_backend
from conveyor.model.config import ModelConfig
from conveyor.model.llama import LlamaForCausalLM
from conveyor.model.ops import make_ops
from conveyor.runner.model_runner import ModelRunner
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler.output import NewRequestData, ScheduledSeq, SchedulerOutput

CFG = ModelConfig(model_type="llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                  rope_theta=10000.0)
BS = 4
PROMPTS = {"a": [5, 9, 14, 3, 77, 21, 8], "b": [40, 2, 19], "c": [11, 12, 13, 14, 15, 16, 17, 18, 60, 61, 62, 63],
           "d": [99, 98, 97, 96, 95]}
TABLES = {"a": [0, 1], "b": [2], "c": [3, 4, 5, 6], "d": [7, 8]}   # room for prompt + 1 decode
FORCED_D = 33   # d's grammar allows this token only


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    backend = make_attention_backend(CFG.num_attention_heads, CFG.num_key_value_heads, CFG.head_dim, "cpu",
                                     torch.float32)
    m = LlamaForCausalLM(CFG, backend, make_ops("cpu", torch.float32))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:   # well-separated logits: no argmax ties
                scale = 3.0 if "lm_head" in name else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * scale / math.sqrt(p.shape[-1]))
    return m.eval()


def params(rid: str) -> SamplingParams:
    if rid == "a":   # random sampling: the sampled token may fall outside the top-1 it asks for
        return SamplingParams(temperature=5.0, logprobs=1)
    return SamplingParams(temperature=0, logprobs=2, presence_penalty=0.3 if rid == "c" else 0.0)


def prefill(rid: str) -> ScheduledSeq:
    p = params(rid)
    n = len(PROMPTS[rid])
    table = TABLES[rid][:-(-n // BS)]
    return ScheduledSeq(rid, PROMPTS[rid], 0, table, NewRequestData(p, 11, 0, None, [] if p.needs_penalties else None),
                        sample=True)


def decode(rid: str, token: int) -> ScheduledSeq:
    n = len(PROMPTS[rid])
    grown = TABLES[rid][-(-n // BS):-(-(n + 1) // BS)]   # the block position n opens, if any
    return ScheduledSeq(rid, [token], n, list(grown), sample=True)


def bitmask(rid: str, plan: SchedulerOutput) -> None:
    """A structured-output mask for d only, named by its id."""
    words = -(-CFG.vocab_size // 32)
    mask = torch.zeros(1, words, dtype=torch.int32)
    mask[0, FORCED_D // 32] = 1 << (FORCED_D % 32)
    plan.grammar_ids, plan.grammar_bitmask = [rid], mask


def run(model, steps: list[list[str]]) -> dict[str, list]:
    """Each step: the requests to run, in plan order (a prefill first time, then decodes)."""
    runner = ModelRunner(model, 16, BS)
    runner.record_logits = True
    got: dict[str, list] = {}
    forget: list[str] = []
    for k, order in enumerate(steps):
        seqs = [decode(r, got[r][-1][0]) if r in got else prefill(r) for r in order]
        plan = SchedulerOutput(k + 1, seqs, forget_ids=forget)
        if "d" in order:
            bitmask("d", plan)
        out = runner.execute(plan)
        assert out.sampled.keys() == set(order)
        for rid in order:
            entry = out.logprobs[rid]
            row = runner.last_logits[rid]
            assert entry.token_id == out.sampled[rid]
            assert entry.rank == int((row > row[entry.token_id]).sum()) + 1   # exact, also outside the top-k
            got.setdefault(rid, []).append((out.sampled[rid], entry.logprobs, entry.rank))
    assert set(runner.state.requests) == {r for step in steps for r in step}
    return got


def test_each_request_gets_its_own_results_whatever_the_row_order(model):
    # Step 2 in the plan: b (context 3), d (a new prefill), a (7), c (12: its decode opens a block).
    # The model lays it out as d, then c, a, b: every row differs from the plan's position.
    batched = run(model, [["c", "a", "b"], ["b", "d", "a", "c"]])
    alone = {rid: run(model, [[rid]] if rid == "d" else [[rid], [rid]])[rid] for rid in PROMPTS}
    for rid in PROMPTS:
        assert [t for t, _, _ in batched[rid]] == [t for t, _, _ in alone[rid]], rid
        for (_, lp, rank), (_, want, want_rank) in zip(batched[rid], alone[rid]):
            assert lp.keys() == want.keys() and rank == want_rank
            assert all(lp[t] == pytest.approx(want[t], abs=1e-4) for t in lp)
    assert batched["d"][0][0] == FORCED_D
