"""Who a request is served for (its tenant), the per-tenant cap on requests in flight, and per-tenant
metrics with a bounded number of label values.

The tenant is the first of:

1. the API key the request was let in with, when the server has several (``--api-key k1,k2,...``):
   ``key-1``, ``key-2``, ... by its place in the list (nothing of the key itself: /metrics is open).
   A client cannot pick another tenant than its key's;
2. the ``x-gateway-inference-fairness-id`` header (the fairness id of the Gateway API Inference
   Extension / llm-d's endpoint picker, so a gateway's flows and the engine's tenants agree);
3. the request body's ``user`` field (OpenAI's end-user id);
4. else the default tenant ``""``.

Without several keys, the header and ``user`` are the client's word: put the server behind a gateway
that sets the header (or give each tenant a key) where tenants must not pose as each other.

The scheduler serves tenants of equal priority by least service (scheduler/fairness.py). Here, at the
front, ``--tenant-max-requests N`` answers a tenant's request beyond N in flight with 429 and
Retry-After, whoever else is busy.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client import Counter as PromCounter

from conveyor.frontend.outputs import RequestOutput
from conveyor.lora.request import LoRARequest
from conveyor.server.errors import APIError

TENANT_HEADER = "x-gateway-inference-fairness-id"
OTHER = "other"          # the label of tenants beyond --tenant-metrics-max
RETRY_AFTER_S = 1
MAX_TENANT_CHARS = 256

QUEUE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)


def key_tenants(keys: list[str]) -> dict[str, str]:
    """API key -> its tenant, ``key-N`` by its place in --api-key (the first of a repeated key)."""
    out: dict[str, str] = {}
    for i, key in enumerate(keys, 1):
        out.setdefault(key, f"key-{i}")
    return out


@dataclass(frozen=True, slots=True)
class Origin:
    """What a request brings besides its prompt: its tenant and the LoRA adapter its model names."""

    tenant: str = ""
    lora: LoRARequest | None = None


class Tenants:
    def __init__(self, api_keys: list[str], max_requests: int, max_labels: int, registry: CollectorRegistry,
                 model_name: str):
        self.by_key = key_tenants(api_keys) if len(api_keys) > 1 else {}
        self.max_requests = max_requests
        self.max_labels = max_labels
        self.model_name = model_name
        self.in_flight: Counter[str] = Counter()   # tenant -> engine requests not finished
        self._owner: dict[str, str] = {}            # engine request id -> its tenant
        self._labels: set[str] = set()
        labels = ["model_name", "tenant"]
        self.prompt_tokens = PromCounter("conveyor:tenant_prompt_tokens", "Prompt tokens of finished requests, "
                                         "per tenant.", labels, registry=registry)
        self.generation_tokens = PromCounter("conveyor:tenant_generation_tokens", "Generated tokens of finished "
                                             "requests, per tenant.", labels, registry=registry)
        self.requests = PromCounter("conveyor:tenant_requests", "Finished requests per tenant.", labels,
                                    registry=registry)
        self.rejected = PromCounter("conveyor:tenant_requests_rejected", "Requests refused with 429: the tenant "
                                    "had --tenant-max-requests in flight.", labels, registry=registry)
        self.queue_time = Histogram("conveyor:tenant_request_queue_time_seconds", "Seconds a sequence waited "
                                    "before its first scheduling, per tenant.", labels, buckets=QUEUE_BUCKETS,
                                    registry=registry)

    def tenant_of(self, api_key: str | None, header: str | None, user: str | None) -> str:
        if self.by_key and api_key in self.by_key:
            return self.by_key[api_key]
        for value, name in ((header, TENANT_HEADER), (user, "user")):
            if value:
                if len(value) > MAX_TENANT_CHARS:
                    raise APIError(400, f"the tenant ({name}) is longer than {MAX_TENANT_CHARS} characters",
                                   param="user" if name == "user" else None)
                return value
        return ""

    def label(self, tenant: str) -> str:
        """The tenant's metrics label: itself for the first --tenant-metrics-max tenants seen, then OTHER."""
        if tenant in self._labels:
            return tenant
        if len(self._labels) < self.max_labels:
            self._labels.add(tenant)
            return tenant
        return OTHER

    def admit(self, tenant: str, n: int) -> None:
        """Raise 429 if `n` more requests would put the tenant over its cap."""
        if self.max_requests and self.in_flight[tenant] + n > self.max_requests:
            self.rejected.labels(self.model_name, self.label(tenant)).inc()
            raise APIError(429, f"too many requests in flight for this tenant ({self.in_flight[tenant]} of at most "
                                f"{self.max_requests}); retry later", code="tenant_over_limit",
                           headers={"Retry-After": str(RETRY_AFTER_S)})

    def started(self, request_id: str, tenant: str) -> None:
        self._owner[request_id] = tenant
        self.in_flight[tenant] += 1

    def finished(self, out: RequestOutput) -> None:
        """A finished engine request (the client's finished listener): off the tenant's count; served
        tokens and queue times go to its metrics."""
        tenant = self._owner.pop(out.request_id, None)
        if tenant is None:
            return
        self.in_flight[tenant] -= 1
        if not self.in_flight[tenant]:
            del self.in_flight[tenant]
        label = self.label(tenant)
        served = [(c, m) for c, m in zip(out.outputs, out.metrics) if c.finish_reason in ("stop", "length")]
        if not served:
            return
        self.requests.labels(self.model_name, label).inc()
        self.prompt_tokens.labels(self.model_name, label).inc(len(out.prompt_token_ids) * len(served))
        self.generation_tokens.labels(self.model_name, label).inc(sum(len(c.token_ids or ()) for c, _ in served))
        for _, m in served:
            if m.queue_time is not None:
                self.queue_time.labels(self.model_name, label).observe(m.queue_time)
