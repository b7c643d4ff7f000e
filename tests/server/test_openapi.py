"""/openapi.json says what the server answers: every status it sends, in the shape it sends it.

A schema-driven fuzzer (schemathesis) generates requests from the running server's own document,
valid and invalid ones, for every operation, and checks each answer against the document: no 5xx,
a documented status, a documented content type, a body conforming to the documented schema.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)
from starlette.testclient import TestClient

from conftest import ServerHandle, start_server
from conveyor.server.app import build_app

KEY = "fuzz-key"
MAX_BODY = 1 << 16
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
OPEN_PATHS = {"/health", "/metrics"}   # ApiKeyMiddleware's: answered without the key
CHECKED = {("POST", "/v1/responses/{response_id}/cancel"),   # 400s without a body: the response's state, paging
           ("GET", "/v1/responses/{response_id}/input_items")}
ENGINE_PATHS = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/embeddings",
                "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"}
# Examples per operation and generation mode; CONVEYOR_HYPOTHESIS_SCALE scales them (tests/conftest.py).
EXAMPLES = max(1, int(10 * float(os.environ.get("CONVEYOR_HYPOTHESIS_SCALE", "1"))))


@pytest.fixture(scope="module")
def fuzzed(demo_model) -> Iterator[ServerHandle]:
    """A server whose context is 64 tokens, so that whatever the fuzzer asks, a generation is short."""
    handle = start_server(demo_model, num_kv_blocks=64, engine_options={"max_model_len": 64}, api_key=KEY,
                          max_body_bytes=MAX_BODY, allow_runtime_lora_updating=True)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def doc(fuzzed) -> dict:
    return fuzzed.http.get("/openapi.json").raise_for_status().json()


@pytest.fixture(scope="module")
def schema(fuzzed):
    return schemathesis.openapi.from_url(f"{fuzzed.url}/openapi.json", config=schemathesis.Config(),
                                         headers=_auth())


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def _operations(doc: dict) -> Iterator[tuple[str, str, dict]]:
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            yield method.upper(), path, operation


def _error_schema(path: str) -> str:
    name = "AnthropicError" if path.startswith("/v1/messages") else "ErrorResponse"
    return f"#/components/schemas/{name}"


# ---- the document ---------------------------------------------------------------------------

def test_every_route_is_documented(fuzzed, doc):
    routes = {(m, r.path_format) for r in fuzzed.server.config.app.routes if hasattr(r, "methods")
              for m in r.methods if r.include_in_schema and m != "HEAD"}
    assert {(m, p) for m, p, _ in _operations(doc)} == routes
    assert len(routes) == 24


def test_every_operation_documents_the_errors_it_sends_in_their_shape(doc):
    for method, path, operation in _operations(doc):
        expected = _errors_sent(method, path, operation)
        responses = operation["responses"]
        assert {int(s) for s in responses if s != "200"} == expected, (method, path)
        for status in expected:
            content = responses[str(status)]["content"]
            assert content == {"application/json": {"schema": {"$ref": _error_schema(path)}}}, (method, path, status)


def _errors_sent(method: str, path: str, operation: dict) -> set[int]:
    """The statuses a route can answer besides 200, from what it does (not from server/openapi.py)."""
    sent = {500}   # the last-resort handler
    if path not in OPEN_PATHS:
        sent.add(401)
    if "requestBody" in operation:   # validation, the body limit, a model named in it
        sent |= {400, 404, 413}
    if "{" in path:   # a stored response or a model named in the path
        sent.add(404)
    if (method, path) in CHECKED:
        sent.add(400)
    if path in ENGINE_PATHS or path == "/health":   # overloaded, shutting down, the engine dead
        sent.add(503)
    if path in ENGINE_PATHS:   # a tenant over --tenant-max-requests
        sent.add(429)
    return sent


def test_validation_errors_are_documented_as_the_400_they_are(fuzzed, doc):
    assert not any("422" in op["responses"] for _, _, op in _operations(doc))
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    r = fuzzed.http.post("/v1/completions", json={"prompt": 3.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_the_error_schemas_are_the_bodies_sent(doc):
    schemas = doc["components"]["schemas"]
    openai = schemas["ErrorInfo"]
    assert set(openai["properties"]) == {"message", "type", "param", "code"}
    assert set(openai["required"]) == {"message", "type"}
    assert schemas["ErrorResponse"]["properties"]["error"] == {"$ref": "#/components/schemas/ErrorInfo"}
    assert set(schemas["AnthropicError"]["properties"]) == {"type", "error"}
    assert set(schemas["AnthropicErrorDetail"]["properties"]) == {"type", "message"}


def test_streaming_routes_declare_an_event_stream(doc):
    for method, path, operation in _operations(doc):
        content = operation["responses"]["200"].get("content", {})
        assert ("text/event-stream" in content) == ("stream" in _body_fields(doc, operation)), (method, path)


def _body_fields(doc: dict, operation: dict) -> dict:
    ref = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {}).get("$ref")
    return doc["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"] if ref else {}


def test_health_declares_what_it_returns(fuzzed, doc):
    assert "content" not in doc["paths"]["/health"]["get"]["responses"]["200"]
    r = fuzzed.http.get("/health")
    assert r.status_code == 200 and r.content == b"" and "content-type" not in r.headers
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert fuzzed.http.get("/metrics").headers["content-type"].startswith("text/plain")


class _Replicated:
    """The engine as a data-parallel client shows itself to /health: one replica up, one down."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def replica_health(self) -> list[bool]:
        return [True, False]


def test_replicated_health_declares_the_json_it_returns(fuzzed):
    http = TestClient(build_app(_Replicated(fuzzed.engine), log_interval=0))   # no lifespan: the engine stays up
    doc = http.get("/openapi.json").json()
    content = doc["paths"]["/health"]["get"]["responses"]["200"]["content"]
    assert content == {"application/json": {"schema": {"$ref": "#/components/schemas/HealthStatus"}}}
    operation = schemathesis.openapi.from_dict(doc, config=schemathesis.Config())["/health"]["GET"]
    r = http.get("/health")
    operation.Case().validate_response(r, checks=CHECKS)
    assert r.json() == {"status": "degraded", "replicas": [{"replica": 0, "up": True}, {"replica": 1, "up": False}]}


# ---- the fuzzer -----------------------------------------------------------------------------

def _fuzz(schema, served: str, examples: int) -> tuple[list[str], int]:
    """Every operation's first failure per generation mode (no shrinking: the report shows the
    case), and the number of cases run."""
    failures, ran = [], [0]
    session = requests.Session()
    for result in schema.get_all_operations():
        operation = result.ok()
        modes = [GenerationMode.POSITIVE]
        if operation.body or operation.query:   # a path's string parameter cannot be made invalid
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:
            try:
                _fuzz_operation(operation, mode, session, served, examples, ran)
            except (Exception, BaseExceptionGroup) as e:   # schemathesis's FailureGroup is a BaseExceptionGroup
                failures.append(f"{operation.label} ({mode.value}): {e}")
    return failures, ran[0]


def _fuzz_operation(operation, mode: GenerationMode, session: requests.Session, served: str, examples: int,
                    ran: list[int]) -> None:
    @settings(max_examples=examples, derandomize=True, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(mode))
    def check(case) -> None:
        ran[0] += 1
        if mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = served   # past the model check, to the engine
        case.call_and_validate(session=session, headers=_auth(), checks=CHECKS, timeout=60)

    check()


@pytest.mark.slow
def test_fuzzed_requests_get_documented_answers(fuzzed, schema):
    start = time.monotonic()
    failures, ran = _fuzz(schema, fuzzed.engine.model_name, EXAMPLES)
    print(f"fuzzed {ran} cases in {time.monotonic() - start:.1f}s")
    assert not failures, "\n\n".join(failures)
    assert ran > 22 * EXAMPLES


@pytest.mark.heavy
def test_fuzzed_requests_get_documented_answers_long(fuzzed, schema):
    failures, _ = _fuzz(schema, fuzzed.engine.model_name, 100)
    assert not failures, "\n\n".join(failures)


@pytest.mark.slow
def test_without_the_key_every_protected_operation_answers_a_documented_401(schema):
    session = requests.Session()
    for result in schema.get_all_operations():
        operation = result.ok()
        response = _minimal(operation).call_and_validate(session=session, checks=CHECKS)
        assert response.status_code == (200 if operation.path in OPEN_PATHS else 401), operation.label


@pytest.mark.slow
def test_every_body_over_the_limit_answers_a_documented_413(schema):
    session = requests.Session()
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.body:
            case = _minimal(operation, body={"prompt": "x" * MAX_BODY})
            assert case.call_and_validate(session=session, headers=_auth(), checks=CHECKS).status_code == 413


def _minimal(operation, body: dict | None = None):
    """A case with made-up path parameters and `body` (or {}) where the operation takes one."""
    path_parameters = {p.name: "x" for p in operation.path_parameters}
    if not operation.body:
        return operation.Case(path_parameters=path_parameters)
    return operation.Case(path_parameters=path_parameters, body=body or {}, media_type="application/json")
