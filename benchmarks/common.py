"""Shared bits of the benchmark scripts: machine info, medians, recording results."""

from __future__ import annotations

import json
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"


def machine() -> dict:
    """The CPU (model, kernel flags), torch, threads and the kernel paths its probes chose: results
    from different machines are not comparable, so every result says where it was measured."""
    from conveyor.profile import machine as conveyor_machine

    return {**conveyor_machine(), "python": platform.python_version()}


def median_time(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def save(name: str, data: dict, doc_line: str) -> Path:
    """Write results JSON and append one line to docs/benchmarks.md's log."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = {"benchmark": name, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(), **data}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=1))
    DOC.parent.mkdir(parents=True, exist_ok=True)
    if not DOC.exists():
        DOC.write_text("# Benchmarks\n\n## Log\n\n")
    with DOC.open("a") as f:
        f.write(f"- {data['date'][:10]} `{name}`: {doc_line} ([json](../benchmarks/results/{name}.json))\n")
    return path
