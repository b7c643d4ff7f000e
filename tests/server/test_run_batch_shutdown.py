"""`conveyor run-batch` as a real process, stopped as the server is (docs/server.md's shutdown table):
SIGTERM, then SIGTERM again 0.5 s later, while lines are in flight. Every line is in the output
once: the answered ones, and the rest (in flight, or never sent) as `batch_cancelled`, which a rerun
answers again; exit 75."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conveyor.server.batch import answered_ids
from test_server_shutdown import EXIT_CUT_SHORT, EXIT_S, LONG, STARTUP_S

pytestmark = pytest.mark.slow


def batch_line(custom_id: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}) + "\n"


def wait_for_lines(path, n: int, proc, log) -> None:
    deadline = time.monotonic() + STARTUP_S
    while not (path.exists() and path.read_text().count("\n") >= n):
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, f"fewer than {n} answers:\n{log.read_text()}"
        time.sleep(0.1)


def test_two_signals_write_every_unanswered_line_as_cancelled(tmp_path):
    short = [f"short-{i}" for i in range(2)]
    long = [f"long-{i}" for i in range(6)]
    src, out, log = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "run.log"
    src.write_text("".join([batch_line(c, {"prompt": "Hi", "max_tokens": 2}) for c in short]
                           + [batch_line(c, LONG) for c in long]))
    with open(log, "w") as f:
        # Three workers: once the two short lines are answered, three long ones are in flight, three unsent.
        proc = subprocess.Popen(
            [sys.executable, "-m", "conveyor", "run-batch", "-i", str(src), "-o", str(out), "--no-progress",
             "--max-concurrency", "3", "--max-num-seqs", "4", "--num-kv-blocks", "800", "--shutdown-timeout", "600"],
            stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_for_lines(out, 2, proc, log)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None   # draining
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        assert proc.wait(timeout=EXIT_S) == EXIT_CUT_SHORT
        assert time.monotonic() - sent < EXIT_S
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(records) == sorted(short + long) and out.read_text().count("\n") == 8
    assert all(records[c]["response"]["status_code"] == 200 for c in short)
    for c in long:
        assert records[c]["response"] is None and records[c]["error"]["code"] == "batch_cancelled", records[c]
    output = log.read_text()
    assert "2 answered (0 not 200), 6 cancelled (rerun to answer them)" in output and "Traceback" not in output
    # A rerun answers the cancelled lines again: they leave the file, the answers stay.
    assert answered_ids(out) == set(short)
    assert sorted(json.loads(line)["custom_id"] for line in out.read_text().splitlines()) == short
