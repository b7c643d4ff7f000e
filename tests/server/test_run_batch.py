"""`conveyor run-batch`: a 200-line OpenAI Batch file (chat and completion lines, greedy and seeded
sampling, a few invalid lines) answered in-process through the real app equals what the HTTP
server answers for the same bodies; lines that cannot be sent get an error object; a run cut
after K answers (and a half-written last line) resumes to every custom_id exactly once."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from conveyor.transport.thread import AsyncEngine
from conveyor.engine.engine import Engine, EngineConfig
from conveyor.server.app import build_app
from conveyor.server.batch import answered_ids, read_requests, run_batch

pytestmark = pytest.mark.slow

SUBJECTS = ["the sea", "a small robot", "winter mornings", "an old library", "the moon", "bread", "a lost key",
            "mountain trains", "jazz", "a quiet village"]
BAD = {  # custom_id -> what the output line must show
    "bad-url": ("error", "invalid_url"),
    "bad-method": ("error", "invalid_method"),
    "bad-stream": ("error", "invalid_body"),
    "bad-temperature": (400, "temperature"),
    "bad-field": (400, "frobnicate"),
}


def batch_lines() -> list[dict]:
    lines = []
    for i in range(195):
        subject = SUBJECTS[i % len(SUBJECTS)]
        sampling = {"max_tokens": 4 + i % 5}
        if i % 3:
            sampling |= {"temperature": 0.7 + 0.1 * (i % 4), "seed": i}
        else:
            sampling |= {"temperature": 0}
        if i % 2:
            body = {"messages": [{"role": "user", "content": f"Write one sentence about {subject}."}], **sampling}
            url = "/v1/chat/completions"
        else:
            body = {"prompt": f"Here is a short story about {subject}:", **sampling}
            url = "/v1/completions"
        lines.append({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body})
    prompt = {"prompt": "Hello", "max_tokens": 4}
    lines += [
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/nope", "body": prompt},
        {"custom_id": "bad-method", "method": "GET", "url": "/v1/completions", "body": prompt},
        {"custom_id": "bad-stream", "method": "POST", "url": "/v1/completions", "body": prompt | {"stream": True}},
        {"custom_id": "bad-temperature", "method": "POST", "url": "/v1/completions",
         "body": prompt | {"temperature": -1}},
        {"custom_id": "bad-field", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Hi"}], "frobnicate": 1}},
    ]
    return lines


def essence(status: int, body: dict) -> tuple:
    """What must match between two answers (not ids or timestamps)."""
    if status != 200:
        return status, body
    if body["object"] == "chat.completion":
        return status, [(c["message"]["content"], c["finish_reason"]) for c in body["choices"]], body["usage"]
    return status, [(c["text"], c["finish_reason"]) for c in body["choices"]], body["usage"]


@pytest.fixture(scope="module")
def lines() -> list[dict]:
    return batch_lines()


@pytest.fixture(scope="module")
def input_file(tmp_path_factory, lines) -> Path:
    path = tmp_path_factory.mktemp("batch") / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def expected(server, lines) -> dict[str, tuple]:
    """The HTTP server's answers to the sendable lines, sent concurrently (so that it batches)."""
    async def main() -> list[httpx.Response]:
        limit = asyncio.Semaphore(64)
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            async def one(line: dict) -> httpx.Response:
                async with limit:
                    return await http.post(line["url"], json=line["body"])
            return await asyncio.gather(*(one(line) for line in sendable))

    sendable = [line for line in lines if BAD.get(line["custom_id"], (0,))[0] != "error"]
    return {line["custom_id"]: essence(r.status_code, r.json()) for line, r in zip(sendable, asyncio.run(main()))}


@pytest.fixture(scope="module")
def app(demo_model):
    config = EngineConfig.from_options(num_kv_blocks=256, block_size=16, enable_prefix_caching=True,
                                       max_num_seqs=32, max_num_batched_tokens=512)
    engine = AsyncEngine(Engine(config, loaded=demo_model))
    yield build_app(engine, log_interval=0)
    engine.close()


def idle_stats(app, timeout: float = 30.0):
    client = app.state.conveyor.client
    deadline = time.monotonic() + timeout
    while (s := client.stats()).num_unfinished_requests or s.num_running or s.num_waiting:
        assert time.monotonic() < deadline, f"engine not idle: {s}"
        time.sleep(0.05)
    return s


def read_output(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check(records: list[dict], lines: list[dict], expected: dict[str, tuple]) -> None:
    assert sorted(r["custom_id"] for r in records) == sorted(line["custom_id"] for line in lines)
    for r in records:
        assert r["id"].startswith("batch_req_")
        want = BAD.get(r["custom_id"])
        if want is not None and want[0] == "error":
            assert r["response"] is None and r["error"]["code"] == want[1] and r["error"]["message"]
            continue
        assert r["error"] is None and r["response"]["request_id"]
        got = essence(r["response"]["status_code"], r["response"]["body"])
        assert got == expected[r["custom_id"]], r["custom_id"]
        if want is not None:   # an invalid body: the server's 400, naming the field
            assert got[0] == 400 and r["response"]["body"]["error"]["param"] == want[1]


def test_batch_equals_the_server(app, input_file, lines, expected, tmp_path):
    out = tmp_path / "out.jsonl"
    summary = asyncio.run(run_batch(app, input_file, out, max_concurrency=128, show_progress=False))
    assert (summary.total, summary.skipped, summary.written, summary.failed) == (200, 0, 200, 5)
    check(read_output(out), lines, expected)
    assert idle_stats(app).kv_usage == 0.0


def test_interrupted_run_resumes(app, lines, expected, tmp_path):
    lines = lines[:55] + lines[-5:]   # a smaller file, to keep the test short
    input_file = tmp_path / "in.jsonl"
    input_file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    first = asyncio.run(run_batch(app, input_file, out, max_concurrency=32, show_progress=False, stop_after=20))
    assert first.written == 20 and len(read_output(out)) == 20
    with open(out, "a") as f:   # a kill in the middle of writing a line
        f.write('{"id": "batch_req_x", "custom_id": "req-1')
    second = asyncio.run(run_batch(app, input_file, out, max_concurrency=32, show_progress=False))
    assert (second.skipped, second.written) == (20, 40)
    check(read_output(out), lines, expected)
    again = asyncio.run(run_batch(app, input_file, out, max_concurrency=32, show_progress=False))
    assert (again.skipped, again.written) == (60, 0)
    stats = idle_stats(app)   # the cut lines' engine requests were aborted
    assert stats.kv_usage == 0.0 and stats.kv_invariant_violations == 0


def test_bad_input_files_fail_before_running(tmp_path):
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n' * 2)
    with pytest.raises(ValueError, match="already used on line 1"):
        read_requests(dup)
    no_id = tmp_path / "no_id.jsonl"
    no_id.write_text('{"method": "POST"}\n')
    with pytest.raises(ValueError, match="custom_id"):
        read_requests(no_id)
    corrupt = tmp_path / "out.jsonl"
    corrupt.write_text('not json\n{"custom_id": "a"}\n')
    with pytest.raises(ValueError, match="refusing"):
        answered_ids(corrupt)


def test_cli_rejects_duplicate_ids_before_loading(tmp_path, capsys):
    from conveyor.cli import main

    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n' * 2)
    assert main(["run-batch", "-i", str(dup), "-o", str(tmp_path / "out.jsonl"), "--no-progress"]) == 1
    assert "custom_id 'a' already used on line 1" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()
