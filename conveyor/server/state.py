"""What the routes share: the engine client, served model names, metrics, token texts."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from conveyor.frontend.client import EngineClient
from conveyor.server.errors import APIError
from conveyor.server.logprobs import TokenTexts
from conveyor.server.loras import LoRARegistry
from conveyor.server.metrics import ServerMetrics
from conveyor.server.tenants import TENANT_HEADER, Origin, Tenants


@dataclass(slots=True)
class ServerState:
    client: EngineClient
    served_model_names: list[str]
    metrics: ServerMetrics
    tool_call_parser: str = "hermes"
    reasoning_parser: str | None = None   # --reasoning-parser (conveyor/server/reasoning.py), None: off
    tenants: Tenants | None = None        # who requests are for, caps, per-tenant metrics (server/tenants.py)
    loras: LoRARegistry | None = None     # LoRA adapters by model name (server/loras.py)
    texts: TokenTexts = field(init=False)

    def __post_init__(self) -> None:
        self.texts = TokenTexts(self.client.tokenizer)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, name: str | None) -> str:
        """The name responses report; 404 for a model this server does not serve (the base model's
        names and the LoRA adapters')."""
        if name is None or name in self.served_model_names:
            return self.model_name if name is None else name
        if self.loras is not None and self.loras.get(name) is not None:
            return name
        served = self.served_model_names + (list(self.loras.adapters) if self.loras is not None else [])
        raise APIError(404, f"the model {name!r} does not exist; this server serves "
                            f"{', '.join(map(repr, served))}", param="model", code="model_not_found")

    def origin(self, raw: Request, model: str | None, user: str | None = None) -> Origin:
        """The request's tenant (server/tenants.py) and the LoRA adapter its model names."""
        lora = self.loras.get(model) if self.loras is not None else None
        if self.tenants is None:
            return Origin("", lora)
        api_key = getattr(raw.state, "api_key", None)
        return Origin(self.tenants.tenant_of(api_key, raw.headers.get(TENANT_HEADER), user), lora)
