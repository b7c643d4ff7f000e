"""What the packed-weights cache (conveyor/model/packed.py) changes: load time, memory while loading,
and memory shared between processes serving the same GGUF.

Each setup loads the model in fresh processes (``loader.load_model``):

- ``off``: ``CONVEYOR_PACKED_WEIGHTS=off`` (read the GGUF's blocks, reorder them, hold them);
- ``miss``: the cache deleted first (read, reorder, write the cache, map it);
- ``hit``: the cache present (map it; the GGUF's blocks are not read).

Two processes load the model at once (as two ``--data-parallel-size`` replicas start; on a miss
one packs while the other waits for the cache file's lock, then maps it). For each: the first
process's seconds to load and peak RSS (the second's are in the JSON), and the two processes'
RSS and PSS once loaded and every weight read once (a page shared by both counts half to each;
/proc/PID/smaps_rollup). The page cache is warm in every setup (the files were read just before),
as on a server that restarts.

    python benchmarks/packed_weights.py [--model PATH.gguf] [--rounds 2] [--name packed_weights]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import save

CHILD = r"""
import json, resource, sys, time
t = time.perf_counter()
from conveyor.model.loader import load_model
loaded = load_model(sys.argv[1])
seconds = time.perf_counter() - t
from conveyor.model.quant import QuantEmbedding, QuantLinear
for m in loaded.model.modules():   # read every weight once, as a decode step does (a mapped page counts once read)
    if isinstance(m, (QuantLinear, QuantEmbedding)):
        m.qweight.sum()
print(json.dumps({"load_s": seconds, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "weights_mib": sum(loaded.model.weight_bytes().values()) / 2**20}), flush=True)
sys.stdin.readline()   # hold the model until told to go
"""


def memory(pid: int) -> dict:
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0]) / 1024   # MiB
    return {"rss_mib": fields["Rss"], "pss_mib": fields["Pss"]}


def start(model: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, model], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def run(model: str, setup: str, cache: Path) -> dict:
    env = {**os.environ, "CONVEYOR_PACKED_WEIGHTS": "off" if setup == "off" else "on"}
    if setup == "miss":
        for f in cache.glob(f"{Path(model).stem}-*.safetensors"):
            f.unlink()
    first = start(model, env)
    second = start(model, env)   # together, as data-parallel replicas start
    one, two = (json.loads(p.stdout.readline()) for p in (first, second))
    time.sleep(0.5)
    mem = [memory(p.pid) for p in (first, second)]
    for p in (first, second):
        p.stdin.write("\n")
        p.stdin.flush()
        p.wait()
    return {**one, "second": two, "two_processes": mem,
            "two_processes_pss_mib": sum(m["pss_mib"] for m in mem),
            "two_processes_rss_mib": sum(m["rss_mib"] for m in mem)}


def main() -> None:
    from conveyor.model.loader import demo_model_path
    from conveyor.paths import cache_dir

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a GGUF file (default: the demo model)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--name", default="packed_weights")
    args = ap.parse_args()
    model = str(args.model or demo_model_path())
    cache = cache_dir() / "packed"
    start(model, {**os.environ, "CONVEYOR_PACKED_WEIGHTS": "off"}).communicate("\n")   # conversion, probes, page cache
    results: dict[str, list[dict]] = {"off": [], "miss": [], "hit": []}
    for _ in range(args.rounds):
        for setup in results:   # "miss" before "hit": it writes what "hit" maps
            results[setup].append(run(model, setup, cache))
            print(setup, results[setup][-1], flush=True)
    med = {s: {k: statistics.median(r[k] for r in rs) for k in ("load_s", "peak_rss_mib", "weights_mib",
                                                                  "two_processes_pss_mib", "two_processes_rss_mib")}
           for s, rs in results.items()}
    line = f"{Path(model).name}, medians of {args.rounds} rounds: " + "; ".join(
        f"{s}: load {m['load_s']:.1f} s, peak RSS {m['peak_rss_mib']:.0f} MiB, two processes PSS "
        f"{m['two_processes_pss_mib']:.0f} MiB (RSS {m['two_processes_rss_mib']:.0f})" for s, m in med.items()) + \
        f"; weights {med['hit']['weights_mib']:.0f} MiB"
    save(args.name, {"model": model, "rounds": results, "medians": med}, line)
    print(line)


if __name__ == "__main__":
    main()
