"""Conveyor: an LLM inference engine built on continuous batching.

The top-level names are imported lazily, so that torch-free parts (``conveyor.scheduler``,
``conveyor.kv``, ``conveyor.sim``) can be imported without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "EngineConfig",
           "SchedulerConfig", "LoRARequest"]

_WHERE = {"LLM": "conveyor.engine.llm", "SamplingParams": "conveyor.sampling.params",
          "StructuredOutputsParams": "conveyor.sampling.structured",
          "RequestOutput": "conveyor.frontend.outputs", "CompletionOutput": "conveyor.frontend.outputs",
          "EngineConfig": "conveyor.config", "SchedulerConfig": "conveyor.scheduler.config",
          "LoRARequest": "conveyor.lora.request"}

if TYPE_CHECKING:
    from conveyor.config import EngineConfig
    from conveyor.engine.llm import LLM
    from conveyor.frontend.outputs import CompletionOutput, RequestOutput
    from conveyor.lora.request import LoRARequest
    from conveyor.sampling.params import SamplingParams
    from conveyor.sampling.structured import StructuredOutputsParams
    from conveyor.scheduler.config import SchedulerConfig


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
