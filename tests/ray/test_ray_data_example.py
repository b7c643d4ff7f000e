"""examples/ray_data_batch.py as docs/scale-out.md runs it, end to end in its own process (its own
local Ray, all of this machine's CPUs): with 2 engines on a 2-CPU machine the actors used to hold
both CPUs and the read task never ran. Also the sizing rule itself, without a cluster."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

from conveyor.ray.data import engine_cpus, max_engines  # noqa: E402

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ray_data_batch.py"


def test_documented_example_finishes_with_two_engines(tmp_path):
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out"
    run = subprocess.run([sys.executable, str(EXAMPLE), str(prompts), str(out), "--demo", "8", "--concurrency", "2",
                          "--max-tokens", "4", "--dtype", "float32"],
                         capture_output=True, text=True, timeout=420, cwd=EXAMPLE.parents[1])
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for f in sorted(out.iterdir()) for line in f.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == list(range(8))
    assert all(r["num_generated_tokens"] == 4 and r["generated_text"] for r in rows)
    assert "8 rows, 32 generated tokens" in run.stdout


def test_engine_cpus_leave_room_for_one_io_task_or_refuse():
    assert engine_cpus(1, 2.0) == 1.0                 # room to spare: 1 CPU each
    assert engine_cpus(2, 2.0) == 0.5                 # 2 x 0.5 + the read task's 1 = 2
    assert engine_cpus(2, 2.0, io_cpus=0.25) == 0.875
    assert engine_cpus(2, 8.0, requested=2.0) == 2.0
    assert engine_cpus(4, 2.0, requested=0) == 0.0   # no reservation asked: oversubscribing on purpose
    with pytest.raises(ValueError, match=r"need 3 CPUs; the cluster has 2"):
        engine_cpus(2, 2.0, requested=1.0)            # the old default: 2 actors took both CPUs
    with pytest.raises(ValueError, match=r"need 1.2 CPUs; the cluster has 1"):
        engine_cpus(2, 1.0)                           # no room left for the engines at all
    assert max_engines(3) == 3 and max_engines((1, 4)) == 4 and max_engines((1, 4, 2)) == 4
