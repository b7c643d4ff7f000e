"""What the routes share: the engine client, served model names, metrics, token texts."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.frontend.client import EngineClient
from conveyor.server.errors import APIError
from conveyor.server.logprobs import TokenTexts
from conveyor.server.metrics import ServerMetrics


@dataclass(slots=True)
class ServerState:
    client: EngineClient
    served_model_names: list[str]
    metrics: ServerMetrics
    tool_call_parser: str = "hermes"
    reasoning_parser: str | None = None   # --reasoning-parser (conveyor/server/reasoning.py), None: off
    texts: TokenTexts = field(init=False)

    def __post_init__(self) -> None:
        self.texts = TokenTexts(self.client.tokenizer)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, name: str | None) -> str:
        """The name responses report; 404 for a model this server does not serve."""
        if name is None or name in self.served_model_names:
            return self.model_name if name is None else name
        raise APIError(404, f"the model {name!r} does not exist; this server serves "
                            f"{', '.join(map(repr, self.served_model_names))}", param="model",
                       code="model_not_found")
