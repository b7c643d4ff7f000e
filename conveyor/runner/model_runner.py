"""The model executor: a step's plan -> tensors -> the model -> sampled tokens; and swap copies.

It keeps each request's block table and sampling state between steps (``RunnerState``, updated
from each plan's deltas), and names every result by request id: logit rows come in the model's
layout (prefills, then decodes by context length) and are never permuted back.
"""

from __future__ import annotations

import dataclasses

import torch

from conveyor.kv.layout import KVLayout
from conveyor.lora.request import LoRARequest
from conveyor.model.cpu_kernels import cpu_kernels
from conveyor.model.llama import LlamaForCausalLM
from conveyor.model.lora import LoRABatch
from conveyor.runner.inputs import ModelInputs, SeqWork, build_inputs
from conveyor.runner.kv_cache import KVCacheTensors
from conveyor.runner.lora import RunnerLoRAs
from conveyor.runner.state import RunnerState
from conveyor.sampling.logits import edit_logits
from conveyor.sampling.sampler import Sampler, SamplerOutput, logprob_entries
from conveyor.scheduler.output import LogprobEntry, ModelOutput, SchedulerOutput


def pooled_rows(s, start: int) -> list[int]:
    """The flattened rows an embedding request pools this step: all of its chunk (mean), or the
    last one (last: the scheduler marks only the chunk that ends the prompt)."""
    if s.pooling == "mean":
        return list(range(start, start + s.num_tokens))
    return [start + s.num_tokens - 1]


def pool_hidden(plan: SchedulerOutput, hidden: torch.Tensor, state: RunnerState) -> dict[str, list[float]]:
    """Add each embedding request's pooled rows (float32: their sum for mean, the last row for last)
    to its running sum in the runner's state; the requests whose prompt ends here get their
    L2-normalised embedding."""
    out, row = {}, 0
    for s in plan.scheduled:
        if s.pooling is None:
            continue
        mean = s.pooling == "mean"
        n = s.num_tokens if mean else 1
        rows = hidden[row:row + n].float()
        row += n
        held = state.requests[s.request_id]
        part = rows.sum(0) if mean else rows[0]
        held.pooled = part if held.pooled is None or not mean else held.pooled + part
        if s.pool_end:
            v = held.pooled / (s.num_computed_tokens + s.num_tokens) if mean else held.pooled
            out[s.request_id] = (v / v.norm().clamp_min(1e-12)).tolist()
    return out


def prompt_logprobs(plan: SchedulerOutput, logits: torch.Tensor) -> dict[str, list[LogprobEntry]]:
    """Per request: {target token: logprob} plus the top-k alternatives and the target's rank, for each row in order."""
    seqs = [s for s in plan.scheduled if s.prompt_targets]
    flat = [t for s in seqs for t in s.prompt_targets]
    entries, ranks = logprob_entries(logits, torch.tensor(flat, device=logits.device),
                                     [s.prompt_logprobs for s in seqs for _ in s.prompt_targets])
    out, row = {}, 0
    for s in seqs:
        end = row + len(s.prompt_targets)
        out[s.request_id] = [LogprobEntry(*e) for e in zip(entries[row:end], flat[row:end], ranks[row:end])]
        row = end
    return out


def sampled_logprobs(ids: list[str], result: SamplerOutput) -> dict[str, LogprobEntry] | None:
    """The sampled tokens' entries, by request id, for the rows that asked for logprobs."""
    out = {rid: LogprobEntry(lp, token, rank)
           for rid, lp, token, rank in zip(ids, result.logprobs, result.token_ids, result.ranks) if lp is not None}
    return out or None


class ModelRunner:
    """Implements the engine core's ``Executor`` protocol with a real model."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, sample: bool = True,
                 layout: KVLayout | None = None, enable_lora: bool = False, max_loras: int = 4,
                 max_lora_rank: int = 64):
        """sample=False: a tensor-parallel rank other than 0 (it runs its slice; the driver samples).
        layout: the layer groups the scheduler's KV manager uses (default: one group of all layers).
        enable_lora: requests may run under LoRA adapters (NewRequestData.lora), up to `max_loras`
        resident at once, of rank up to `max_lora_rank` (runner/lora.py)."""
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        self.layout = layout if layout is not None and not layout.trivial else None
        self.null_block = num_blocks   # (used only by a windowed layout: the block past the pool)
        windowed = layout is not None and layout.windowed
        self.kv = KVCacheTensors(model.cfg, num_blocks, block_size, device, dtype, layout=layout, null_block=windowed)
        pin = self.device.type == "cuda"
        self.host = KVCacheTensors(model.cfg, max(num_host_blocks, 1), block_size, "cpu", dtype, pin_memory=pin,
                                   layout=layout)
        self.kv_layers = self.kv.layers
        kernels = cpu_kernels(self.device, dtype)
        self.sampler = Sampler(kernels.argmax_rows if kernels is not None else None) if sample else None
        self.state = RunnerState()       # each request's block table and sampling state, from the plans' deltas
        self.loras = RunnerLoRAs(model, self.state, max_loras, max_lora_rank, self.device) if enable_lora else None
        self.record_logits = False       # tests: keep the latest step's logits rows, by request id
        self.last_logits: dict[str, torch.Tensor] = {}

    @torch.inference_mode()
    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        # Swap-outs first: blocks they vacate may be reused by swap-ins and by this very step.
        self.kv.copy_blocks_to(self.host, swap_out)
        self.host.copy_blocks_to(self.kv, swap_in)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        logits, inputs = self.forward(plan)
        pooled = None
        if isinstance(logits, tuple):   # embedding requests: their rows' hidden states come back too
            logits, hidden = logits
            pooled = pool_hidden(plan, hidden, self.state) or None
        prompt = None
        if inputs.logits_indices.numel() < logits.shape[0]:   # rows for prompt logprobs follow the sampled ones
            prompt = prompt_logprobs(plan, logits[inputs.logits_indices.numel():])
            logits = logits[:inputs.logits_indices.numel()]
        # Logit rows follow the model's layout; each is named by its request id from here on.
        seqs = [plan.scheduled[i] for i in inputs.sample_order]
        if any(s.num_drafts for s in seqs):
            return self._verify(plan, logits, seqs, prompt, pooled)
        ids = [s.request_id for s in seqs]
        rows = [self.state.row(rid) for rid in ids]
        edit_logits(logits, ids, rows, plan.grammar_ids, plan.grammar_bitmask)
        if self.record_logits:
            self.last_logits = dict(zip(ids, logits))
        if not ids:
            return ModelOutput({}, None, prompt, pooled)
        result = self.sampler(logits, rows)
        return ModelOutput(dict(zip(ids, result.token_ids)), sampled_logprobs(ids, result), prompt, pooled)

    def _verify(self, plan: SchedulerOutput, logits: torch.Tensor, seqs: list, prompt, pooled) -> ModelOutput:
        """A step with speculative tokens: every sampling sequence has 1 + num_drafts logits rows (its
        known token's, then each draft's); each row is verified at its own position
        (Sampler.verify), and a sequence keeps its drafts up to the first refused one, then the
        token drawn there (or after its last draft, a token of its own)."""
        ids, rows, drafts = [], [], []
        for s in seqs:
            row = self.state.row(s.request_id)
            proposed = s.draft_token_ids
            history = row.output_token_ids
            for j in range(1 + s.num_drafts):
                ids.append(s.request_id)
                # each position's own state: its output count, and the history the drafts before it extend
                rows.append(row if j == 0 else dataclasses.replace(
                    row, num_output_tokens=row.num_output_tokens + j,
                    output_token_ids=None if history is None else history + proposed[:j]))
                drafts.append(proposed[j] if j < s.num_drafts else -1)
        # (a grammar's mask rows: one per position of a speculating request, after each draft)
        edit_logits(logits, ids, rows, plan.grammar_ids, plan.grammar_bitmask)
        result = self.sampler.verify(logits, rows, drafts)
        sampled, accepted, logprobs, draft_logprobs = {}, {}, {}, {}
        r = 0
        for s in seqs:
            rid, k = s.request_id, s.num_drafts
            a = 0
            while a < k and result.accepted[r + a]:
                a += 1
            sampled[rid] = result.emitted[r + a]
            if self.record_logits:
                self.last_logits[rid] = logits[r + a]
            if result.logprobs[r] is not None:
                entries = [LogprobEntry(result.logprobs[i], result.emitted[i], result.ranks[i])
                           for i in range(r, r + a + 1)]
                logprobs[rid] = entries[-1]
                if a:
                    draft_logprobs[rid] = entries[:-1]
            if k:
                accepted[rid] = a
                self.state.accept(rid, a)
            r += 1 + k
        return ModelOutput(sampled, logprobs or None, prompt, pooled, accepted, draft_logprobs or None)

    @torch.inference_mode()
    def forward(self, plan: SchedulerOutput):
        """The model on the plan's tokens: (logits in the model's row order, the inputs built).
        Takes the plan's deltas into the runner's state first (every tensor-parallel rank calls this)."""
        self.state.apply(plan)
        table = self.state.block_table
        work = [SeqWork(s.token_ids, s.num_computed_tokens, table(s.request_id), s.sample, 1 + s.num_drafts)
                for s in plan.scheduled]
        inputs = build_inputs(work, self.block_size, self.device, self.model.attn_backend.max_decode_groups,
                              self.layout, self.null_block)
        indices = inputs.logits_indices
        extra = [inputs.starts[i] + s.prompt_targets_row + j for i, s in enumerate(plan.scheduled)
                 if s.prompt_targets for j in range(len(s.prompt_targets))]
        if extra:   # prompt logprobs: the logits of the rows whose next token is a prompt token too
            indices = torch.cat([indices, torch.tensor(extra, dtype=indices.dtype, device=indices.device)])
        hidden = [r for i, s in enumerate(plan.scheduled) if s.pooling is not None
                  for r in pooled_rows(s, inputs.starts[i])]
        hidden_idx = torch.tensor(hidden, dtype=indices.dtype, device=indices.device) if hidden else None
        return self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_layers, indices,
                          hidden_idx, lora=self._lora_batch(plan, inputs)), inputs

    def _lora_batch(self, plan: SchedulerOutput, inputs: ModelInputs) -> LoRABatch | None:
        if self.loras is not None:
            return self.loras.batch(plan, inputs)
        for s in plan.scheduled:
            if s.new is not None and s.new.lora is not None:
                raise ValueError(f"request {s.request_id!r} asks for LoRA adapter {s.new.lora.lora_name!r}, "
                                 f"but this engine does not serve LoRA (enable_lora is off)")
        return None

    # ---- LoRA adapters (the resident ones; requests bring theirs in NewRequestData.lora) ----------
    def add_lora(self, lora: LoRARequest) -> None:
        """Read an adapter now and keep it resident (LoRAAdapterError, a ValueError, if refused)."""
        if self.loras is None:
            raise ValueError(f"cannot load LoRA adapter {lora.lora_name!r}: enable_lora is off")
        self.loras.add(lora)

    def remove_lora(self, lora: str | int) -> bool:
        """Drop a resident adapter, by lora_name or lora_int_id; whether it was resident."""
        return self.loras is not None and self.loras.manager.remove(lora)

    def list_loras(self) -> list[LoRARequest]:
        """The resident adapters, least recently used first."""
        return [] if self.loras is None else self.loras.manager.resident()
