"""The runner's LoRA adapters: the resident ones (``LoRAManager``) and each step's rows by adapter.

A request's adapter comes once, with its NewRequestData, and stays in the runner's state; every
row of its chunks (speculative drafts included) runs under it. Per step the distinct adapters of
the scheduled requests are made resident (read from their PEFT directories on a miss) and their
rows handed to the model as a ``LoRABatch``; a step with no adapter hands none.
"""

from __future__ import annotations

import numpy as np
import torch

from conveyor.lora.adapter import read_adapter
from conveyor.lora.manager import LoRAManager
from conveyor.lora.request import LoRARequest
from conveyor.model.llama import LlamaForCausalLM
from conveyor.model.cpu_kernels import cpu_kernels
from conveyor.model.lora import AdapterDeltas, LoRABatch, Rows, base_shapes, fuse
from conveyor.runner.inputs import ModelInputs
from conveyor.runner.state import RunnerState
from conveyor.scheduler.output import SchedulerOutput


class RunnerLoRAs:
    def __init__(self, model: LlamaForCausalLM, state: RunnerState, max_loras: int, max_lora_rank: int,
                 device: torch.device):
        cfg, dtype, base = model.cfg, model.dtype, base_shapes(model.cfg)
        self.device = device
        self.state = state
        # the C++ kernel for small steps (model/lora.py); off: the grouped torch ops for every step
        self.kernel = cpu_kernels(device, dtype) is not None
        self.manager: LoRAManager[AdapterDeltas] = LoRAManager(
            max_loras, lambda lora: fuse(read_adapter(lora, base, max_lora_rank, dtype, device), cfg),
            self._in_use)

    def _in_use(self) -> set[int]:
        return {r.lora.lora_int_id for r in self.state.requests.values() if r.lora is not None}

    def batch(self, plan: SchedulerOutput, inputs: ModelInputs) -> LoRABatch | None:
        """The step's adapters (made resident) and the flattened rows of each; None without any."""
        requests = self.state.requests
        loras = [requests[s.request_id].lora for s in plan.scheduled]
        distinct = list({lora.lora_int_id: lora for lora in loras if lora is not None}.values())
        if not distinct:
            return None
        adapters = self.manager.acquire(distinct)
        group = {lora.lora_int_id: g for g, lora in enumerate(distinct)}
        of_seq = np.array([-1 if lora is None else group[lora.lora_int_id] for lora in loras], dtype=np.int32)
        of_row = np.repeat(of_seq[inputs.order], inputs.num_tokens)   # (laid-out order: prefills, then decodes)
        if self.kernel:   # the rows under an adapter, sorted by it (the base model's, -1, first: dropped)
            order = np.argsort(of_row, kind="stable").astype(np.int32)
            bounds = np.searchsorted(of_row[order], np.arange(-1, len(distinct) + 1)).astype(np.int32)
            return LoRABatch(adapters, [], torch.from_numpy(order[bounds[1]:]),
                             torch.from_numpy(bounds[1:] - bounds[1]))
        if len(distinct) == 1 and all(lora is not None for lora in loras):
            return LoRABatch(adapters, [slice(None)])   # every row under one adapter: no gather
        return LoRABatch(adapters, [self._rows(np.flatnonzero(of_row == g)) for g in range(len(distinct))])

    def _rows(self, idx: np.ndarray) -> Rows:
        if idx[-1] - idx[0] + 1 == len(idx):   # one run: a view, no gather
            return slice(int(idx[0]), int(idx[-1]) + 1)
        return torch.from_numpy(idx).to(self.device)

    def add(self, lora: LoRARequest) -> None:
        """Read `lora` now (refused adapters raise here) and hold it, as a step's only adapter would be."""
        self.manager.acquire([lora])
