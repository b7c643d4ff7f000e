"""The engine's options, written once.

``EngineConfig`` (and the ``SchedulerConfig`` it holds) is the single source: the flags of
``conveyor generate`` / ``conveyor serve`` and the keywords of ``LLM(...)`` are generated from
their fields, names and help texts. No torch here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from typing import Any

from conveyor.config_fields import add_options, check_choice, option
from conveyor.scheduler.config import SchedulerConfig
from conveyor.spec.speculator import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "weight-only", "none")   # as conveyor.model.quant.QUANTIZATIONS (no torch here)
TP_BACKENDS = ("mp", "ray")


@dataclass(slots=True)
class EngineConfig:
    model: str | None = option(None, "HF model directory or .gguf file (default: the demo model)", cli=False)
    tokenizer: str | None = option(None, "HF directory (or .gguf) to take the tokenizer from (default: the model's)")
    device: str = option("cpu", "torch device (cpu, cuda)")
    dtype: str = option("auto", "weights, activations and KV cache dtype; auto: bfloat16 on CPUs with native bf16 "
                                "matmuls (AMX or AVX512-BF16) and GPUs, else float32, the same at every start "
                                "(float16: CUDA only)", choices=DTYPES)
    quantization: str = option(
        "auto", "GGUF weights: auto computes the matmuls of Q4_0/Q4_1/Q8_0 tensors from their blocks as stored "
                "(CPU, C++ kernels; other types are dequantized at load), with activations rounded to int8 per "
                "block of 32 where the CPU has AVX512-VNNI (as llama.cpp does); weight-only keeps fp32 "
                "activations (the dequantized model's results up to summation order); none dequantizes every "
                "tensor to dtype at load", choices=QUANTIZATIONS)
    block_size: int = option(16, "tokens per KV cache block")
    num_kv_blocks: int | None = option(None, "KV cache size in blocks (overrides kv_cache_gib)")
    kv_cache_gib: float = option(1.0, "memory for the KV cache, in GiB")
    swap_space_gib: float = option(0.5, "host memory for swapped-out KV, in GiB")
    max_model_len: int | None = option(None, "cap on prompt + output tokens (default: the model's context, "
                                             "bounded by the KV cache)")
    enable_prefix_caching: bool = option(True, "share KV blocks of identical prompt prefixes")
    hybrid_kv_cache: bool = option(
        True, "models with sliding-window layers (Gemma 3, Mistral v0.1): layer groups with their own block "
              "tables, local groups giving back blocks that left their window (off: one table for all layers, "
              "every block kept for the whole sequence)")
    seed: int = option(0, "engine seed for requests that give none")
    generation_config: str = option(
        "auto", "default sampling parameters for fields a request omits (temperature, top_p, top_k, min_p, "
                "repetition_penalty, max_tokens), as vLLM: 'auto' takes the model's (an HF directory's "
                "generation_config.json; a GGUF's general.sampling metadata or a generation_config.json beside "
                "it; the demo model's built-in ones); 'vllm' none; or a folder / JSON file to read them from")
    override_generation_config: str | None = option(
        None, "a JSON object of default sampling parameters merged over --generation-config's, e.g. "
              "'{\"temperature\": 0.5}' (offline: a dict)")
    speculative_config: str | None = option(
        None, "speculative decoding, as a JSON object (offline: a dict) with vLLM's names: "
              "'{\"method\": \"ngram\", \"num_speculative_tokens\": 5}'; methods ngram (prompt lookup) and "
              "suffix (also the outputs of recent requests with the same cache salt); options prompt_lookup_min, "
              "prompt_lookup_max, adaptive (default true: the step-cost model picks how many drafts each step, "
              "none when they would not pay); see docs/speculative.md (default: off)")
    torch_threads: int | None = option(None, "CPU threads for torch (default: all cores; 1 can be faster when "
                                             "other work shares them)")
    max_consecutive_step_failures: int = option(
        3, "failed steps in a row (exceptions in the forward pass, sampling or a swap copy) after which the "
           "engine gives up; a single failure only fails the requests of its step")
    cost_model: str | None = option(
        "auto", "a `conveyor profile` JSON whose measured costs the auto preemption mode uses ('auto': the "
                "profile saved for this model and dtype, if there is one; 'none': the swap_cost_per_block and "
                "recompute_cost_per_token constants)")
    step_trace: str | None = option(None, "record every step and write the trace to this JSON file (and a "
                                          "Chrome/Perfetto trace beside it) at the end of generate() or serve; "
                                          "data-parallel and Ray Serve replicas each write NAME.replicaR.json")
    tensor_parallel_size: int = option(
        1, "ranks that each hold a slice of every layer (Megatron-style, over torch.distributed: gloo on CPU, "
           "NCCL on CUDA); spawned on this machine, or joined under torchrun")
    distributed_executor_backend: str = option(
        "mp", "how tensor-parallel ranks 1..N-1 start: 'mp' spawns them on this machine; 'ray' places them as Ray "
              "actors in a placement group (the engine's own when it runs inside one, e.g. a Ray Serve replica, "
              "else a new PACK group; they may span nodes; rank 0's node address is the master; torch_threads "
              "is then per rank). Under torchrun the group is torchrun's", choices=TP_BACKENDS)
    kv_events_endpoint: str | None = option(
        None, "publish KV cache events in vLLM's wire format (ZMQ PUB + msgpack) for prefix-aware routers "
              "(llm-d, Dynamo): tcp://*:5557 binds, tcp://HOST:PORT connects to a subscriber that binds; "
              "data-parallel replica i uses port + i (default: off)")
    kv_events_replay_endpoint: str | None = option(
        None, "ZMQ ROUTER endpoint that replays recent KV-event batches from a given sequence number "
              "(e.g. tcp://*:5558; replica i: port + i)")
    kv_events_topic: str = option("", "topic frame of every KV-event message (llm-d expects kv@POD@MODEL)")
    kv_events_buffer_steps: int = option(10_000, "KV-event batches (one per engine step with events) kept "
                                                 "for the replay endpoint")
    kv_events_hwm: int = option(100_000, "ZMQ high-water mark of the KV-event publisher: messages queued per "
                                         "subscriber before a slow one loses batches")
    data_parallel_rank: int = option(0, "this engine's replica index among data-parallel replicas: the KV events' "
                                        "dp_rank and port offset (set per replica by --data-parallel-size; give "
                                        "it yourself when each replica is its own server)")
    enable_lora: bool = option(False, "serve LoRA adapters (PEFT directories) over the base model, several in one batch")
    max_loras: int = option(4, "LoRA adapters resident at once (a request for another evicts the least recently used "
                               "idle one)")
    max_lora_rank: int = option(64, "largest LoRA rank accepted (an adapter of higher rank is refused)")
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        SpeculativeConfig.parse(self.speculative_config)   # a bad one fails here, before anything loads
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("quantization", self.quantization, QUANTIZATIONS)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        check_choice("distributed_executor_backend", self.distributed_executor_backend, TP_BACKENDS)
        if self.max_consecutive_step_failures < 1:
            raise ValueError("max_consecutive_step_failures must be >= 1")
        if self.kv_events_buffer_steps < 1 or self.kv_events_hwm < 1:
            raise ValueError("kv_events_buffer_steps and kv_events_hwm must be >= 1")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        if self.data_parallel_rank < 0:
            raise ValueError(f"data_parallel_rank must be >= 0, got {self.data_parallel_rank}")

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """A config from flat keywords: EngineConfig's and SchedulerConfig's fields by name."""
        ours, sched = _split(options)
        return cls(**ours, scheduler=SchedulerConfig(**sched))


def option_names() -> tuple[list[str], list[str]]:
    """Flat option names of EngineConfig and of SchedulerConfig."""
    return ([f.name for f in fields(EngineConfig) if f.name != "scheduler"],
            [f.name for f in fields(SchedulerConfig)])


def _split(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    engine_names, sched_names = option_names()
    unknown = sorted(set(options) - set(engine_names) - set(sched_names))
    if unknown:
        raise TypeError(f"unknown engine option(s) {', '.join(unknown)}; the options are: "
                        f"{', '.join(engine_names + sched_names)}")
    return ({k: v for k, v in options.items() if k in engine_names},
            {k: v for k, v in options.items() if k in sched_names})


# ---- command lines ---------------------------------------------------------------------------

def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per option of EngineConfig and SchedulerConfig (--max-num-seqs, ...), but those in `skip`."""
    group = parser.add_argument_group("engine")
    for cls in (EngineConfig, SchedulerConfig):
        add_options(group, cls, skip)


def config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The EngineConfig that parsed flags (from add_engine_args) describe."""
    engine_names, sched_names = option_names()
    options = {name: getattr(args, name) for name in engine_names + sched_names if hasattr(args, name)}
    options.update(overrides)
    return EngineConfig.from_options(**options)
