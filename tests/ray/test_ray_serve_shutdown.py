"""`conveyor serve --ray` as a real process, shut down as `conveyor serve` is (docs/server.md's table):
SIGTERM, then SIGTERM again 0.5 s later, with streams and a non-streaming request in flight through
Serve's proxy. Ray's own SIGTERM handler (installed by ray.init) must not take over: every stream ends
with an error event and [DONE], the non-streaming request gets a 503, the app is deleted and Ray shut
down, exit 75."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray")

from conveyor.bench.serve import free_port  # noqa: E402

pytestmark = pytest.mark.slow


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod   # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _shutdown_helpers():
    """tests/server/test_server_shutdown.py's helpers, loaded by path with tests/server/conftest.py as the
    `conftest` it imports (the one importable by that name here is tests/ray's)."""
    here = os.path.join(os.path.dirname(__file__), "..", "server")
    ours = sys.modules.get("conftest")
    sys.modules["conftest"] = _load("conveyor_server_conftest", os.path.join(here, "conftest.py"))
    try:
        return _load("conveyor_shutdown_helpers", os.path.join(here, "test_server_shutdown.py"))
    finally:
        if ours is None:
            del sys.modules["conftest"]
        else:
            sys.modules["conftest"] = ours


def test_second_signal_ends_every_request_in_flight_with_an_error(tmp_path):
    h = _shutdown_helpers()
    port = free_port()
    url, path = f"http://127.0.0.1:{port}", tmp_path / "serve.log"
    with open(path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "conveyor", "serve", "--ray", "--port", str(port), "--num-kv-blocks", "800",
             "--max-num-seqs", "4", "--shutdown-timeout", str(h.DRAIN_S), "--torch-threads", "1"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        h.wait_healthy(proc, url, path, h.STARTUP_S)
        plain = h.Plain(url, h.LONG)
        streams = [h.Stream(url, h.LONG) for _ in range(2)]
        assert all(st.started.wait(120) for st in streams)
        h.wait_in_flight(url, 3)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None   # draining
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        for st in streams:
            h.assert_ended_with_error(st.ended())
        h.assert_unavailable(plain.answer())
        assert h.exit_code(proc, sent) == h.EXIT_CUT_SHORT
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = path.read_text()
    assert "SIGTERM during the drain: aborting the requests in flight" in output, output[-3000:]
