"""Which LoRA adapter a request runs under (vLLM's LoRARequest: name, integer id, path).

No torch here: the scheduler, the wire and the front end carry it; the runner loads the
adapter it names (conveyor/lora/) the first time a request brings it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    lora_name: str     # what clients call it (`model=` in the OpenAI API)
    lora_int_id: int   # >= 1, unique per adapter while it is registered (0 = the base model)
    lora_path: str     # a PEFT directory: adapter_config.json + adapter_model.safetensors

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def cache_key(self) -> str:
        """What separates its KV in the prefix cache (and the router's view of it): the id too, so a
        name registered again with other weights never meets the old blocks."""
        return f"{self.lora_int_id}:{self.lora_name}"


def adapter_key(lora: LoRARequest | None) -> str | None:
    return None if lora is None else lora.cache_key
