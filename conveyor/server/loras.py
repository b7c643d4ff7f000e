"""LoRA adapters by name, as vLLM's server has them: ``--lora-modules name=path ...`` at start, and
``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` at run time when runtime updates are
allowed (``--allow-runtime-lora-updating``, or vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``). A
request picks an adapter by ``model=<name>``; ``/v1/models`` lists them (``root``: the path,
``parent``: the base model).

The engine loads an adapter's weights the first time a request brings it, and keeps at most
``--max-loras`` of them resident (least recently used evicted; conveyor/lora/). Unloading a name
stops new requests from picking it; requests already running under it finish under it. A name loaded
again gets a new id, so its prefix-cache blocks never mix with the old weights' (kv/block_keys.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, Field

from conveyor.lora.peft_config import LoRAAdapterError, read_peft_config
from conveyor.lora.request import LoRARequest
from conveyor.server import openapi
from conveyor.server.errors import APIError

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


def parse_lora_modules(items: list[str] | None) -> list[tuple[str, str]]:
    """``name=path`` items (or vLLM's JSON form ``{"name": ..., "path": ...}``) as (name, path)."""
    out = []
    for item in items or []:
        if item.lstrip().startswith("{"):
            try:
                d = json.loads(item)
                out.append((str(d["name"]), str(d["path"])))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"lora_modules: expected name=path or {{\"name\": ..., \"path\": ...}}, got {item!r}")
            continue
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"lora_modules: expected name=path, got {item!r}")
        out.append((name.strip(), path.strip()))
    return out


class LoRARegistry:
    """Adapter names -> LoRARequest. Whether the engine runs adapters is checked where it is known:
    `conveyor serve` refuses --lora-modules without --enable-lora, and an engine without LoRA refuses
    a request that names one (a Ray ingress cannot tell before its replicas report)."""

    def __init__(self, base_names: list[str]):
        self.base_names = base_names
        self.adapters: dict[str, LoRARequest] = {}
        self._next_id = 1

    def add(self, name: str, path: str) -> LoRARequest:
        if name in self.adapters or name in self.base_names:
            raise APIError(400, f"the model name {name!r} is already taken", param="lora_name")
        try:   # what the engine would refuse, refused now (its rank limit is checked when a request brings it)
            read_peft_config(path, name, max_rank=1 << 30)
        except LoRAAdapterError as e:
            raise APIError(400, str(e), param="lora_path") from None
        lora = LoRARequest(name, self._next_id, str(Path(path)))
        self._next_id += 1
        self.adapters[name] = lora
        return lora

    def remove(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise APIError(404, f"no LoRA adapter named {name!r}", param="lora_name", code="lora_not_found")

    def get(self, model: str | None) -> LoRARequest | None:
        return None if model is None else self.adapters.get(model)


def runtime_updates_allowed(flag: bool) -> bool:
    return flag or os.environ.get(RUNTIME_ENV, "").strip().lower() in ("1", "true")


def register_lora_routes(app: FastAPI, registry: LoRARegistry) -> None:
    @app.post("/v1/load_lora_adapter", response_class=Response,
              responses=openapi.responses(openapi.BODY, text="text/plain"))
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        registry.add(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=Response,
              responses=openapi.responses(openapi.BODY, text="text/plain"))
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        registry.remove(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
