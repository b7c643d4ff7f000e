"""The executor: turns a SchedulerOutput into tensors, runs the model, samples, applies swaps."""

from __future__ import annotations

import torch

from conveyor.model.llama import LlamaForCausalLM
from conveyor.runner.inputs import SeqWork, build_inputs
from conveyor.runner.kv_cache import KVCacheTensors
from conveyor.sampling.sampler import Sampler, SamplingRow
from conveyor.scheduler.output import ModelOutput, SchedulerOutput


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        self.kv = KVCacheTensors(model.cfg, num_blocks, block_size, device, dtype)
        pin = self.device.type == "cuda"
        self.host = KVCacheTensors(model.cfg, max(num_host_blocks, 1), block_size, "cpu", dtype, pin_memory=pin)
        self.kv_layers = self.kv.layers
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelOutput:
        # Swap-outs first: blocks they vacate may be rewritten by this very step.
        self.kv.copy_blocks_to(self.host, out.swap_out)
        self.host.copy_blocks_to(self.kv, out.swap_in)
        if not out.scheduled:
            return ModelOutput([], [])
        work = []
        for s in out.scheduled:
            req, c = s.request, s.request.num_computed_tokens
            work.append(SeqWork(req.all_token_ids[c:c + s.num_tokens], c, s.block_table, s.sample))
        inputs = build_inputs(work, self.block_size, self.device, self.model.attn_backend.max_decode_groups)
        logits = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_layers, inputs.logits_indices)
        # Logit rows follow the model's layout; the scheduler expects scheduling order.
        row_of = {idx: r for r, idx in enumerate(inputs.sample_order)}
        sampled = [i for i, s in enumerate(out.scheduled) if s.sample]
        perm = [row_of[i] for i in sampled]
        if perm != list(range(len(perm))):
            logits = logits[torch.tensor(perm, device=logits.device)]
        rows = []
        for i in sampled:
            req = out.scheduled[i].request
            rows.append(SamplingRow(req.params, req.prompt_token_ids, req.output_token_ids, req.seed))
        result = self.sampler(logits, rows)
        return ModelOutput(result.token_ids, result.logprobs)
