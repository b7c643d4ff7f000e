"""`conveyor run-batch`: a JSONL file of API requests in, one answer per line out (OpenAI's Batch format).

Each input line is ``{"custom_id", "method": "POST", "url", "body"}``. It is sent to the real
server app (built in-process over an engine, reached through httpx's ASGI transport), so a line
gets exactly what the HTTP server would answer: validation, errors and all. Up to
`max_concurrency` lines are in flight at once (the engine batches them); each answer is appended
to the output as soon as it is complete, so a killed run is resumed by running it again: the
custom_ids already in the output are skipped (a last line cut by the kill is dropped first).
SIGTERM / SIGINT stop it as they stop the server (server/shutdown.py): lines in flight get the
shutdown timeout to finish, and every line left unanswered is written with the error code
``batch_cancelled`` (OpenAI's, for a cancelled batch), which a rerun answers again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from conveyor.config import add_engine_args, config_from_args
from conveyor.server.cli import read_chat_template
from conveyor.server.config import ServerConfig
from conveyor.server.shutdown import EXIT_CUT_SHORT, Signals

CANCELLED = "batch_cancelled"   # the error code of a line a stopped run left unanswered

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score", "/v1/rerank")


@dataclass(slots=True)
class BatchLine:
    custom_id: str
    method: Any
    url: Any
    body: Any


@dataclass(slots=True)
class BatchSummary:
    total: int        # lines in the input
    skipped: int      # already answered in the output (resumed)
    written: int      # answered by this run
    failed: int       # of which not a 200 (an HTTP error or a request that could not be sent)
    cancelled: int = 0   # left unanswered by a SIGTERM / SIGINT: written as batch_cancelled, rerun to answer


def read_requests(path: Path) -> list[BatchLine]:
    """The input's requests; ValueError (naming the line) for a line that is not a request object
    with a string custom_id, or for a custom_id seen twice, before anything runs."""
    lines: list[BatchLine] = []
    seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not valid JSON: {e}") from e
            if not isinstance(obj, dict) or not isinstance(obj.get("custom_id"), str):
                raise ValueError(f"{path}:{number}: a request needs a string custom_id")
            cid = obj["custom_id"]
            if cid in seen:
                raise ValueError(f"{path}:{number}: custom_id {cid!r} already used on line {seen[cid]}")
            seen[cid] = number
            lines.append(BatchLine(cid, obj.get("method"), obj.get("url"), obj.get("body")))
    return lines


def answered_ids(path: Path) -> set[str]:
    """custom_ids already in the output. What must be answered again leaves the file first: a last
    line without its newline (cut by a kill) and the lines a stopped run cancelled."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    dropped = end < len(data)
    kept, ids = [], set()
    for number, text in enumerate(data[:end].decode("utf-8").splitlines(keepends=True), 1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
            cid = record["custom_id"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{number}: not a batch output line ({e}); refusing to append to it") from e
        if _cancelled(record):
            dropped = True
            continue
        ids.add(cid)
        kept.append(text)
    if dropped:
        _rewrite(path, "".join(kept))
    return ids


def _cancelled(record: dict) -> bool:
    return isinstance(record.get("error"), dict) and record["error"].get("code") == CANCELLED


def _rewrite(path: Path, text: str) -> None:
    """Replace the file's contents at once: a kill leaves the old file or the new one, never half."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _record(custom_id: str, response: dict | None, error: dict | None) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}


def cancelled_record(line: BatchLine) -> dict:
    return _record(line.custom_id, None, {"code": CANCELLED, "message": "the run was stopped (SIGTERM / SIGINT) "
                                          "before this line was answered; a rerun answers it"})


def _line_error(line: BatchLine) -> dict | None:
    """A non-HTTP error for a line that cannot be sent (OpenAI's `error` object), else None."""
    if line.method != "POST":
        return {"code": "invalid_method", "message": f"method must be POST, got {line.method!r}"}
    if line.url not in URLS:
        return {"code": "invalid_url", "message": f"url must be one of {', '.join(URLS)}, got {line.url!r}"}
    if not isinstance(line.body, dict):
        return {"code": "invalid_body", "message": "body must be a JSON object"}
    if line.body.get("stream"):
        return {"code": "invalid_body", "message": "stream is not supported in a batch (each answer is one object)"}
    return None


async def answer(http: Any, line: BatchLine) -> dict:
    """The output record of one line, from the app's answer to it."""
    error = _line_error(line)
    if error is not None:
        return _record(line.custom_id, None, error)
    try:
        r = await http.post(line.url, json=line.body)
        body = r.json()
    except Exception as e:   # noqa: BLE001 - one line's failure must not end the batch
        return _record(line.custom_id, None, {"code": "request_failed", "message": f"{type(e).__name__}: {e}"})
    return _record(line.custom_id, {"status_code": r.status_code, "request_id": f"req_{uuid.uuid4().hex}",
                                    "body": body}, None)


async def run_lines(app: Any, lines: Iterable[BatchLine], out: TextIO, max_concurrency: int,
                    progress: Any = None, stop_after: int | None = None) -> tuple[int, int, int]:
    """Answer `lines` through `app`, appending each record to `out` as it completes; (written, failed,
    cancelled). Once the app's drain started (a signal), lines get no more requests: the ones its
    shutdown aborted and the ones never sent are written as cancelled.
    `stop_after`: stop (as if killed) once that many are written, in-flight lines unanswered."""
    import httpx   # lazy: optional dependency (httpx)

    todo = iter(lines)
    written = failed = cancelled = 0
    done = asyncio.Event()

    client = app.state.conveyor.client
    drain = app.state.drain

    def write(record: dict) -> None:
        nonlocal written, failed, cancelled
        out.write(json.dumps(record) + "\n")   # one write: a kill cuts at most this line
        out.flush()
        if _cancelled(record):
            cancelled += 1
        else:
            written += 1
            failed += record["error"] is not None or record["response"]["status_code"] != 200
        if progress is not None:
            progress.update(1)

    async def worker(http: httpx.AsyncClient) -> None:
        for line in todo:   # the workers share one iterator: each line is taken once
            if drain.started:
                write(cancelled_record(line))
                continue
            record = await answer(http, line)
            if done.is_set():   # stopped (stop_after) while this line was in flight
                return
            if drain.started:
                if _status(record) == 503:   # aborted by the shutdown, or sent after it began
                    record = cancelled_record(line)
            elif not client.is_healthy:   # its 503 is not this line's answer: stop; a rerun resumes here
                raise RuntimeError(f"the engine stopped ({client.dead_reason or 'shut down'}); "
                                   f"{written} answers written, rerun to resume")
            write(record)
            if stop_after is not None and written >= stop_after:
                done.set()
                return

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as http:
        workers = [asyncio.create_task(worker(http)) for _ in range(max_concurrency)]
        stopper = asyncio.create_task(done.wait())
        running = set(workers)
        try:   # until every line is answered, a worker fails, or stop_after cuts the lines in flight
            while running and not stopper.done():
                finished, _ = await asyncio.wait([*running, stopper], return_when=asyncio.FIRST_COMPLETED)
                for t in finished - {stopper}:
                    running.discard(t)
                    t.result()
        finally:
            for t in [*workers, stopper]:
                t.cancel()
            await asyncio.gather(*workers, stopper, return_exceptions=True)
    return written, failed, cancelled


def _status(record: dict) -> int | None:
    return None if record["response"] is None else record["response"]["status_code"]


async def run_batch(app: Any, input_path: Path, output_path: Path, max_concurrency: int,
                    show_progress: bool = True, stop_after: int | None = None) -> BatchSummary:
    """Run the input's requests not yet answered in the output through `app`; append their answers."""
    lines = read_requests(input_path)
    done = answered_ids(output_path)
    todo = [line for line in lines if line.custom_id not in done]
    progress = None
    if show_progress:
        from tqdm import tqdm   # lazy: keeps tqdm out of the CLI's start-up

        progress = tqdm(total=len(lines), initial=len(lines) - len(todo), unit="req", desc="run-batch")
    try:
        with open(output_path, "a", encoding="utf-8") as out:
            written, failed, cancelled = await run_lines(app, todo, out, max_concurrency, progress, stop_after)
    finally:
        if progress is not None:
            progress.close()
    return BatchSummary(len(lines), len(lines) - len(todo), written, failed, cancelled)


# ---- command line ---------------------------------------------------------------------------------

def add_run_batch_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "run-batch", help="answer a JSONL file of API requests offline (OpenAI Batch format)",
        description="Answer each line of an OpenAI Batch input file ({custom_id, method, url, body}) as the server "
                    "would, writing {id, custom_id, response: {status_code, request_id, body}, error} lines in "
                    "completion order. Rerunning resumes: custom_ids already in the output are skipped.")
    p.add_argument("model", nargs="?", default=None, help="HF model directory or .gguf file (default: the demo model)")
    p.add_argument("-i", "--input-file", required=True, help="the requests, one JSON object per line")
    p.add_argument("-o", "--output-file", required=True, help="the answers (appended to: a rerun resumes)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="lines in flight at once (default: 4 x --max-num-seqs, so that the engine's batch stays full)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) the bodies may give (default: the model's name)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template (a file path, or the template text)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--shutdown-timeout", type=float, default=ServerConfig().shutdown_timeout,
                   help="on SIGTERM / Ctrl-C, seconds the lines in flight get to finish; a second signal stops "
                        "at once. Lines left unanswered are written as batch_cancelled (a rerun answers them); "
                        "the exit status is then 75")
    add_engine_args(p)
    p.set_defaults(func=cmd_run_batch)
    return p


def cmd_run_batch(args: argparse.Namespace) -> int:
    # lazy: keeps torch out of the CLI's start-up
    from conveyor.transport.thread import AsyncEngine
    from conveyor.server.app import build_app

    input_path, output_path = Path(args.input_file), Path(args.output_file)
    if input_path.resolve() == output_path.resolve():
        raise ValueError("the output file must not be the input file")
    read_requests(input_path)   # a bad input fails before the model loads
    config = config_from_args(args, model=args.model)
    engine = AsyncEngine.from_config(config)
    try:
        if args.chat_template:
            engine.tokenizer.chat_template = read_chat_template(args.chat_template)
        app = build_app(engine, served_model_name=args.served_model_name, log_interval=0,
                        shutdown_timeout=args.shutdown_timeout)
        concurrency = args.max_concurrency or 4 * config.scheduler.max_num_seqs
        signals = Signals.install()
        summary = asyncio.run(_run_until_drained(app, signals, input_path, output_path, concurrency,
                                                 show_progress=not args.no_progress and os.isatty(2)))
    finally:
        engine.close()
    cancelled = f", {summary.cancelled} cancelled (rerun to answer them)" if summary.cancelled else ""
    print(f"{summary.written} answered ({summary.failed} not 200){cancelled}, {summary.skipped} already in "
          f"{output_path}, {summary.total} requests in {input_path}")
    return EXIT_CUT_SHORT if summary.cancelled else 0


async def _run_until_drained(app: Any, signals: Signals, *args: Any, **kw: Any) -> BatchSummary:
    """run_batch, stopped by SIGTERM / SIGINT as the server is; the engine shut down at the end."""
    signals.attach_drain(app.state.drain, asyncio.get_running_loop())
    try:
        return await run_batch(app, *args, **kw)
    finally:
        await app.state.drain.wait()
