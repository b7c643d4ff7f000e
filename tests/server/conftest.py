"""Servers on loopback for the HTTP tests: uvicorn in a background thread over the demo model.

The model is loaded once per session and shared by every server's engine (each has its own
KV cache, scheduler and engine thread).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import openai
import pytest
import torch
import uvicorn

from conveyor.bench.serve import free_port  # noqa: F401 - the server tests import it from here
from conveyor.transport.thread import AsyncEngine
from conveyor.engine.engine import Engine, EngineConfig
from conveyor.core.stats import EngineStats
from conveyor.model.loader import LoadedModel, load_model
from conveyor.server.app import build_app


@dataclass
class ServerHandle:
    port: int
    engine: AsyncEngine
    server: uvicorn.Server
    thread: threading.Thread
    api_key: str | None = None
    _http: httpx.Client | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def http(self) -> httpx.Client:
        if self._http is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._http = httpx.Client(base_url=self.url, timeout=120, headers=headers)
        return self._http

    def openai(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0,
                             timeout=120, **kw)

    def async_openai(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0,
                                  timeout=120, **kw)

    def metrics(self, by_replica: bool = False) -> dict[str, float]:
        return scrape_metrics(self.http, by_replica)

    def wait_idle(self, timeout: float = 30.0) -> EngineStats:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.engine.stats()
            if s.num_unfinished_requests == 0 and s.num_running == 0 and s.num_waiting == 0:
                return s
            time.sleep(0.05)
        raise AssertionError(f"engine not idle after {timeout}s: {self.engine.stats()}")

    def stop(self) -> None:
        if self._http is not None:
            self._http.close()
        self.server.should_exit = True
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()


def wait_healthy(proc, url: str, log_path, timeout: float) -> None:
    """Poll `url`/health until it answers 200; fail with the process's log if it exits or times out."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log_path.read_text()
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"server did not come up:\n{log_path.read_text()}"
        time.sleep(0.2)


def scrape_metrics(http: httpx.Client, by_replica: bool = False) -> dict[str, float]:
    """Samples of /metrics as {name{labels}: value}, parsed with prometheus_client's parser; the
    per-replica series summed over replicas unless `by_replica`."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    drop = {"model_name"} if by_replica else {"model_name", "replica"}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in drop)
            key = f"{s.name}{{{labels}}}" if labels else s.name
            out[key] = out.get(key, 0.0) + s.value
    return out


def start_server(loaded: LoadedModel, *, num_kv_blocks: int = 256, max_num_seqs: int = 32,
                 max_waiting: int | None = None, enable_prefix_caching: bool = True,
                 engine_options: dict | None = None, **app_kwargs) -> ServerHandle:
    config = EngineConfig.from_options(num_kv_blocks=num_kv_blocks, block_size=16,
                                       enable_prefix_caching=enable_prefix_caching, max_num_seqs=max_num_seqs,
                                       max_num_batched_tokens=512, **(engine_options or {}))
    engine = AsyncEngine(Engine(config, loaded=loaded), max_waiting=max_waiting)
    app = build_app(engine, log_interval=app_kwargs.pop("log_interval", 0), shutdown_timeout=5, **app_kwargs)
    port = free_port()
    # Idle keep-alive connections stay open for the session: with uvicorn's 5 s default, a test that
    # spends longer than that between two requests of a shared client can send on a connection the
    # server is closing at that moment ("connection reset by peer"; the clients do not retry).
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=5, timeout_keep_alive=600))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    return ServerHandle(port, engine, server, thread, api_key=app_kwargs.get("api_key"))


@pytest.fixture(scope="session")
def demo_model() -> LoadedModel:
    return load_model(None, "cpu", torch.float32)


@pytest.fixture(scope="session")
def server(demo_model) -> Iterator[ServerHandle]:
    """The shared server: 256 blocks of 16 tokens, up to 32 sequences per step."""
    handle = start_server(demo_model)
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return server.openai()


@pytest.fixture(scope="session")
def model_name(server) -> str:
    return server.engine.model_name


@pytest.fixture(scope="session")
def limited_server(demo_model) -> Iterator[ServerHandle]:
    """One sequence at a time, at most 2 waiting, and an API key."""
    handle = start_server(demo_model, num_kv_blocks=64, max_num_seqs=1, max_waiting=2, api_key="secret")
    yield handle
    handle.stop()
