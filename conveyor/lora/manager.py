"""The LoRA adapters resident at once: at most ``max_loras``, each read on first use.

When a slot is needed, the least recently used adapter that no live request runs under goes
first; failing that, the least recently used one that is not in the current step (a request
that holds it reads it again when it next runs: the same file, the same tensors, the same
results). Only a step with more than ``max_loras`` distinct adapters cannot be served (the
scheduler keeps a step within that). Torch-free: what an adapter is held as (``T``) is whatever
``load`` returns.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from conveyor.lora.request import LoRARequest

T = TypeVar("T")


class LoRASlotsError(RuntimeError):
    """More distinct adapters in one step than there are slots."""


@dataclass(slots=True)
class _Resident(Generic[T]):
    lora: LoRARequest
    weights: T


class LoRAManager(Generic[T]):
    def __init__(self, max_loras: int, load: Callable[[LoRARequest], T],
                 in_use: Callable[[], set[int]] = lambda: set()):
        """`load`: read an adapter (may raise, e.g. LoRAAdapterError); `in_use`: the lora_int_ids live
        requests run under (asked only when a slot must be freed)."""
        assert max_loras >= 1
        self.max_loras = max_loras
        self._load = load
        self._in_use = in_use
        self._resident: OrderedDict[int, _Resident[T]] = OrderedDict()   # least recently used first
        self.num_loads = 0

    def __len__(self) -> int:
        return len(self._resident)

    def __contains__(self, lora_int_id: int) -> bool:
        return lora_int_id in self._resident

    def resident(self) -> list[LoRARequest]:
        """The adapters held, least recently used first."""
        return [r.lora for r in self._resident.values()]

    def acquire(self, loras: Sequence[LoRARequest]) -> list[T]:
        """The weights of a step's distinct adapters, in the order given, each made resident (read
        on a miss, evicting as the module says) and marked as just used."""
        if len(loras) > self.max_loras:
            raise LoRASlotsError(f"{len(loras)} LoRA adapters in one step, above max_loras {self.max_loras}")
        step = {lora.lora_int_id for lora in loras}
        return [self._get(lora, step) for lora in loras]

    def _get(self, lora: LoRARequest, step: set[int]) -> T:
        held = self._resident.get(lora.lora_int_id)
        if held is not None:
            if held.lora != lora:
                raise ValueError(f"lora_int_id {lora.lora_int_id} is adapter {held.lora.lora_name!r} "
                                 f"({held.lora.lora_path}), not {lora.lora_name!r} ({lora.lora_path}): remove it first")
            self._resident.move_to_end(lora.lora_int_id)
            return held.weights
        weights = self._load(lora)   # before evicting: an adapter refused evicts nothing
        self.num_loads += 1
        if len(self._resident) >= self.max_loras:
            self._evict(step)
        self._resident[lora.lora_int_id] = _Resident(lora, weights)
        return weights

    def _evict(self, step: set[int]) -> None:
        others = [i for i in self._resident if i not in step]
        if not others:   # (acquire checks the count: only a caller's own bookkeeping gets here)
            raise LoRASlotsError(f"all {self.max_loras} LoRA slots hold adapters of this step")
        live = self._in_use()
        victim = next((i for i in others if i not in live), others[0])
        del self._resident[victim]

    def remove(self, lora: str | int) -> bool:
        """Drop an adapter, by lora_name or lora_int_id; whether it was resident. A request still
        running under it reads it again at its next step."""
        key = lora if isinstance(lora, int) else next(
            (i for i, r in self._resident.items() if r.lora.lora_name == lora), None)
        return self._resident.pop(key, None) is not None
