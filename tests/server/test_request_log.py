"""--log-requests: one JSON line per API request, whatever its end (ok, 400, client gone)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from conftest import start_server

pytestmark = pytest.mark.slow

PROMPT = "Name three colours of the rainbow."


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.raw: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.raw.append(record.getMessage())

    def wait(self, count: int, timeout: float = 30.0) -> list[dict]:
        """The lines so far, once there are `count` of them (some are written when the engine answers an abort)."""
        deadline = time.monotonic() + timeout
        while len(self.raw) < count:
            assert time.monotonic() < deadline, f"{len(self.raw)} request log lines, expected {count}: {self.raw}"
            time.sleep(0.02)
        time.sleep(0.1)   # a line too many would show up here
        assert len(self.raw) == count, self.raw
        return [json.loads(line) for line in self.raw]


@pytest.fixture(scope="module")
def log_server(demo_model):
    handle = start_server(demo_model, log_requests=True)
    yield handle
    handle.stop()


@pytest.fixture
def lines() -> Iterator[_Lines]:
    logger = logging.getLogger("conveyor.requests")
    handler, level = _Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _check_times(line: dict, before: float) -> None:
    assert before - 1 <= line["arrival_time"] <= time.time()
    assert 0 <= line["queue_time"] <= line["ttft"] <= line["e2e"]
    assert line["num_preemptions"] == 0 and line["priority"] == 0


def test_chat(log_server, lines):
    before = time.time()
    r = log_server.openai().chat.completions.create(model=log_server.engine.model_name, max_tokens=5, temperature=0,
                                                    messages=[{"role": "user", "content": PROMPT}])
    [line] = lines.wait(1)
    assert line["request_id"] == r.id and line["endpoint"] == "/v1/chat/completions"
    assert line["status"] == "ok" and line["http_status"] == 200
    assert line["model"] == log_server.engine.model_name and line["n"] == 1
    assert line["prompt_tokens"] == r.usage.prompt_tokens
    assert line["output_tokens"] == r.usage.completion_tokens
    assert line["finish_reasons"] == [r.choices[0].finish_reason]
    _check_times(line, before)
    assert "prompt" not in line and "output" not in line
    assert "rainbow" not in lines.raw[0] and r.choices[0].message.content not in lines.raw[0]


def test_completion_n2(log_server, lines):
    before = time.time()
    r = log_server.openai().completions.create(model=log_server.engine.model_name, prompt=PROMPT, n=2, max_tokens=4,
                                               temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    [line] = lines.wait(1)
    assert line["request_id"] == r.id and line["endpoint"] == "/v1/completions" and line["n"] == 2
    assert line["prompt_tokens"] == r.usage.prompt_tokens
    assert line["output_tokens"] == r.usage.completion_tokens == 8
    assert line["finish_reasons"] == ["length", "length"] and line["status"] == "ok"
    _check_times(line, before)


def test_stream(log_server, lines):
    before = time.time()
    chunks = list(log_server.openai().chat.completions.create(
        model=log_server.engine.model_name, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, messages=[{"role": "user", "content": PROMPT}]))
    usage = chunks[-1].usage
    [line] = lines.wait(1)
    assert line["request_id"] == chunks[0].id and line["status"] == "ok" and line["http_status"] == 200
    assert (line["prompt_tokens"], line["output_tokens"]) == (usage.prompt_tokens, usage.completion_tokens)
    assert line["finish_reasons"] == [next(c.choices[0].finish_reason for c in chunks
                                           if c.choices and c.choices[0].finish_reason)]
    _check_times(line, before)


def test_context_length_400(log_server, lines):
    with pytest.raises(openai.BadRequestError):
        log_server.openai().completions.create(model=log_server.engine.model_name, prompt="hello " * 10_000,
                                               max_tokens=4)
    [line] = lines.wait(1)
    assert line["status"] == "context_length_exceeded" and line["http_status"] == 400
    assert line["endpoint"] == "/v1/completions" and line["request_id"] is None
    assert line["prompt_tokens"] is None and line["output_tokens"] is None and line["finish_reasons"] == []
    assert "hello" not in lines.raw[0]


def test_client_disconnect_mid_stream(log_server, lines):
    body = {"prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=log_server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            got = [x for x, _ in zip((x for x in r.iter_lines() if x.startswith("data:")), range(3))]
            assert len(got) == 3
    [line] = lines.wait(1)   # written once the engine has answered the abort
    assert line["status"] == "aborted" and line["http_status"] == 200
    assert line["finish_reasons"] == ["abort"] and 2 <= line["output_tokens"] < 2000
    assert line["request_id"] == json.loads(got[0][5:])["id"]


def test_client_disconnect_while_waiting(log_server, lines):
    with httpx.Client(base_url=log_server.url, timeout=httpx.Timeout(60, read=1.0)) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPT}],
                                                    "max_tokens": 2000, "ignore_eos": True})
    [line] = lines.wait(1)
    assert line["status"] == "aborted" and line["http_status"] == 499
    assert line["finish_reasons"] == ["abort"] and line["endpoint"] == "/v1/chat/completions"


def test_request_text(demo_model, lines):
    handle = start_server(demo_model, log_requests=True, log_request_text=True)
    try:
        r = handle.openai().chat.completions.create(model=handle.engine.model_name, max_tokens=5, temperature=0,
                                                    messages=[{"role": "user", "content": PROMPT}])
        [line] = lines.wait(1)
        assert PROMPT in line["prompt"] and line["output"] == [r.choices[0].message.content]
    finally:
        handle.stop()


def test_off_by_default(server, lines):
    server.openai().completions.create(model=server.engine.model_name, prompt=PROMPT, max_tokens=2)
    time.sleep(0.1)
    assert lines.raw == []


def test_cached_tokens_count_prefix_cache_hits(log_server, lines):
    """The second of two identical long prompts reads the first one's full blocks from the prefix
    cache: its line (and RequestOutput.num_cached_tokens) says how many tokens."""
    client = log_server.openai()
    prompt = "Count slowly: " + " ".join(str(i) for i in range(60))   # > 4 blocks of 16 tokens
    for _ in range(2):
        r = client.completions.create(model=log_server.engine.model_name, prompt=prompt, max_tokens=2,
                                      temperature=0)
    first, second = lines.wait(2)
    assert first["cached_tokens"] == 0
    assert second["cached_tokens"] >= 48 and second["cached_tokens"] % 16 == 0
    assert second["cached_tokens"] < r.usage.prompt_tokens
