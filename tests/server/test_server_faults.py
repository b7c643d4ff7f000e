"""Over real HTTP: an engine fault fails only its requests (500 / an error event, then [DONE]); repeated
faults mark the engine dead (/health 503, /metrics still true); bad input is a 400, an unknown
exception a clean 500 that keeps the connection; big inputs are refused or tokenized off the loop."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest

from conftest import start_server
from conveyor.model.loader import LoadedModel
from conveyor.scheduler.output import ModelOutput, SchedulerOutput
from conveyor.server.inputs import OFF_LOOP_CHARS

pytestmark = pytest.mark.slow

GREEDY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


class Switch:
    """The engine's executor, raising in the next `fail_next` execute() calls."""

    def __init__(self, runner):
        self.runner = runner
        self.fail_next = 0
        self.after = 0   # let this many execute() calls pass before failing

    def swap(self, swap_out, swap_in) -> None:
        self.runner.swap(swap_out, swap_in)

    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        if self.fail_next > 0:
            if self.after > 0:
                self.after -= 1
            else:
                self.fail_next -= 1
                raise RuntimeError("injected forward failure")
        return self.runner.execute(plan)


@pytest.fixture(scope="module")
def flaky(demo_model):
    handle = start_server(demo_model, num_kv_blocks=128)
    engine = handle.engine.engine
    switch = Switch(engine.runner)
    engine.core.executor = switch
    yield handle, switch
    handle.stop()


def _error_body(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_a_failed_step_is_a_500_and_the_server_goes_on(flaky):
    server, switch = flaky
    want = server.http.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"]
    switch.fail_next = 1
    err = _error_body(server.http.post("/v1/completions", json=GREEDY), 500)
    assert err["type"] == "server_error" and "injected forward failure" in err["message"]
    assert server.http.get("/health").status_code == 200
    assert server.http.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"] == want
    m = server.metrics()
    assert m["conveyor:engine_step_failures_total"] >= 1 and m["conveyor:engine_dead"] == 0
    server.wait_idle()
    assert server.metrics()["conveyor:kv_cache_usage_perc"] == 0.0


def test_a_failed_step_mid_stream_ends_with_an_error_event_then_done(flaky):
    server, switch = flaky
    switch.after, switch.fail_next = 3, 1
    with server.http.stream("POST", "/v1/completions", json={**GREEDY, "max_tokens": 50, "stream": True}) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "server_error" and "injected forward failure" in err["message"]
    assert any("choices" in json.loads(e) for e in events[:-2])   # tokens came before the fault
    server.wait_idle()
    assert server.metrics()["conveyor:kv_cache_usage_perc"] == 0.0
    assert server.http.get("/health").status_code == 200


def test_repeated_failures_mark_the_engine_dead(demo_model):
    server = start_server(demo_model, num_kv_blocks=64)
    try:
        engine = server.engine.engine
        switch = Switch(engine.runner)
        switch.fail_next = 100
        engine.core.executor = switch
        for _ in range(engine.config.max_consecutive_step_failures):
            _error_body(server.http.post("/v1/completions", json=GREEDY), 500)
        health = server.http.get("/health")
        assert health.status_code == 503 and "consecutive steps failed" in health.json()["error"]["message"]
        m = server.metrics()
        assert m["conveyor:engine_dead"] == 1 and m["conveyor:replica_up"] == 0
        load = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")   # a dead engine has no load
        assert not [name for name in m if name.split(":")[-1] in load]                   # gauges (no 0 read as idle)
        assert m["conveyor:engine_step_failures_total"] == engine.config.max_consecutive_step_failures
        err = _error_body(server.http.post("/v1/completions", json=GREEDY), 503)
        assert err["code"] == "unavailable"
    finally:
        server.stop()


# ---- bad input --------------------------------------------------------------------------------

SURROGATE = "ab\ud800cd"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": SURROGATE, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", SURROGATE], "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SURROGATE}], "max_tokens": 2}, "messages"),
    ("/tokenize", {"prompt": SURROGATE}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": SURROGATE}]}, "messages"),
])
def test_lone_surrogate_is_a_400(server, path, body, param):
    raw = json.dumps(body)   # json.dumps writes the lone surrogate as the escape \\ud800
    assert "\\ud800" in raw
    r = server.http.post(path, content=raw, headers={"Content-Type": "application/json"})
    err = _error_body(r, 400)
    assert err["param"] == param and "surrogate" in err["message"]
    assert server.http.post("/v1/completions", json=GREEDY).status_code == 200


class TrickyTokenizer:
    """The demo tokenizer, raising a non-HTTP exception on "boom" and recording who tokenizes big texts."""

    def __init__(self, real):
        self._real = real
        self.calls = 0
        self.big_threads: list[str] = []

    def __getattr__(self, name):
        return getattr(self._real, name)

    def encode(self, text, add_special_tokens=True):
        self.calls += 1
        if len(text) > OFF_LOOP_CHARS:
            self.big_threads.append(threading.current_thread().name)
        if "boom" in text:
            raise RuntimeError("an unexpected bug")
        return self._real.encode(text, add_special_tokens=add_special_tokens)


@pytest.fixture(scope="module")
def tricky(demo_model):
    tok = TrickyTokenizer(demo_model.tokenizer)
    loaded = LoadedModel(demo_model.config, demo_model.model, tok, demo_model.path, demo_model.name)
    handle = start_server(loaded, num_kv_blocks=64)
    yield handle, tok
    handle.stop()


def _request(body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)


def _read_response(sock: socket.socket, buf: bytes) -> tuple[int, dict, bytes]:
    """(status, body, bytes left over) of one HTTP/1.1 response with a Content-Length."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        buf += chunk
    head, buf = buf.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    assert headers.get("connection", "").lower() != "close"
    length = int(headers["content-length"])
    while len(buf) < length:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        buf += chunk
    return int(lines[0].split()[1]), json.loads(buf[:length]), buf[length:]


def test_an_unknown_exception_is_a_500_that_keeps_the_connection(tricky):
    server, _ = tricky
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(_request({"prompt": "boom", "max_tokens": 2}))
        status, body, rest = _read_response(sock, b"")
        assert status == 500 and body["error"]["type"] == "server_error"
        assert "RuntimeError" in body["error"]["message"] and "unexpected bug" not in body["error"]["message"]
        sock.sendall(_request(GREEDY))   # the same keep-alive connection
        status, body, _ = _read_response(sock, rest)
        assert status == 200 and body["choices"][0]["text"]


def test_a_huge_prompt_is_refused_without_tokenizing(tricky):
    server, tok = tricky
    calls = tok.calls
    r = server.http.post("/v1/completions", json={"prompt": "a " * 2_000_000, "max_tokens": 2})   # 4 MB
    err = _error_body(r, 400)
    assert err["code"] == "context_length_exceeded" and "at least" in err["message"]
    assert tok.calls == calls
    r = server.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a " * 2_000_000}]})
    assert _error_body(r, 400)["code"] == "context_length_exceeded" and tok.calls == calls


def test_big_inputs_are_tokenized_off_the_event_loop(tricky):
    server, tok = tricky
    text = "word " * (OFF_LOOP_CHARS // 4)
    r = server.http.post("/tokenize", json={"prompt": text})
    assert r.status_code == 200 and r.json()["count"] > OFF_LOOP_CHARS // 8
    r = server.http.post("/v1/completions", json={"prompt": text, "max_tokens": 2})
    assert _error_body(r, 400)["code"] == "context_length_exceeded"
    assert len(tok.big_threads) == 2
    assert not any(name.startswith("uvicorn-") for name in tok.big_threads), tok.big_threads
