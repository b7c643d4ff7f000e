"""The model executor: a step's plan -> tensors -> the model -> sampled tokens; and swap copies."""

from __future__ import annotations

import torch

from conveyor.model.cpu_kernels import cpu_kernels
from conveyor.model.llama import LlamaForCausalLM
from conveyor.runner.inputs import SeqWork, build_inputs
from conveyor.runner.kv_cache import KVCacheTensors
from conveyor.sampling.sampler import Sampler
from conveyor.sampling.structured import apply_bitmask
from conveyor.scheduler.output import ModelOutput, SchedulerOutput


class ModelRunner:
    """Implements the engine core's ``Executor`` protocol with a real model."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, sample: bool = True):
        """sample=False: a tensor-parallel rank other than 0 (it runs its slice; the driver samples)."""
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        self.kv = KVCacheTensors(model.cfg, num_blocks, block_size, device, dtype)
        pin = self.device.type == "cuda"
        self.host = KVCacheTensors(model.cfg, max(num_host_blocks, 1), block_size, "cpu", dtype, pin_memory=pin)
        self.kv_layers = self.kv.layers
        kernels = cpu_kernels(self.device, dtype)
        self.sampler = Sampler(kernels.argmax_rows if kernels is not None else None) if sample else None
        self.record_logits = False       # tests: keep the latest step's logits (rows in scheduling order)
        self.last_logits: torch.Tensor | None = None

    @torch.inference_mode()
    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        # Swap-outs first: blocks they vacate may be reused by swap-ins and by this very step.
        self.kv.copy_blocks_to(self.host, swap_out)
        self.host.copy_blocks_to(self.kv, swap_in)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        logits, inputs = self.forward(plan)
        # Logit rows follow the model's layout; the sampler and the scheduler use scheduling order.
        row_of = {idx: r for r, idx in enumerate(inputs.sample_order)}
        sampled = [i for i, s in enumerate(plan.scheduled) if s.sampling is not None]
        perm = [row_of[i] for i in sampled]
        if perm != list(range(len(perm))):
            logits = logits[torch.tensor(perm, device=logits.device)]
        if plan.grammar_bitmask is not None:   # structured outputs: disallowed tokens to -inf
            apply_bitmask(logits, plan.grammar_rows, plan.grammar_bitmask)
        if self.record_logits:
            self.last_logits = logits
        result = self.sampler(logits, [plan.scheduled[i].sampling for i in sampled])
        return ModelOutput(result.token_ids, result.logprobs)

    @torch.inference_mode()
    def forward(self, plan: SchedulerOutput):
        """The model on the plan's tokens: (logits in the model's row order, the inputs built)."""
        work = [SeqWork(s.token_ids, s.num_computed_tokens, s.block_table, s.sampling is not None)
                for s in plan.scheduled]
        inputs = build_inputs(work, self.block_size, self.device, self.model.attn_backend.max_decode_groups)
        return self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_layers,
                          inputs.logits_indices), inputs
