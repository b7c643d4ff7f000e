"""Conveyor: an LLM inference engine built on continuous batching."""

from conveyor.engine.llm import LLM
from conveyor.engine.outputs import CompletionOutput, RequestOutput
from conveyor.sampling.params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
