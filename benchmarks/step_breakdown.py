"""Where a step's time goes: the reference workload (64 requests, prompts 32-256, outputs 16-256,
greedy, ignore_eos) through the offline engine with every component timed in place.

Categories (seconds and share of the wall time):

- ``matmul <shape> <path>``: each CpuLinear call by weight shape, path (``gemv`` = Conveyor's C++
  kernel, ``onednn`` = prepacked oneDNN, ``mkl`` = F.linear) and token bucket, with its GFLOP/s;
- ``fused decode layers``: steps within the GEMV threshold run every decoder layer in one C++
  call (matmuls, attention, norms inside it; not split further);
- ``attention prefill`` (SDPA), ``attention decode`` (the paged C++ kernel), ``kv write``;
- ``norms/rope/activation``: the fused elementwise ops;
- ``sampling``; ``model other`` (embedding, gathers, Python between the ops);
- ``runner other`` (building the step's input tensors); ``engine other`` (scheduling, outputs,
  detokenizing: the step minus the runner).

Each timer is two ``perf_counter`` calls around a synchronous CPU call (the CPU path runs
eagerly), which adds ~1 us per call; the total of the timed run against an untimed run of the
same workload is reported as ``overhead``.

    python benchmarks/step_breakdown.py [--dtypes float32,bfloat16] [--name step_breakdown]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from common import save  # noqa: E402
from offline_worker import workload  # noqa: E402

from conveyor import LLM, SamplingParams  # noqa: E402
from conveyor.model.linear import CpuLinear  # noqa: E402

SHAPE_NAMES = {(576, 960): "qkv", (576, 576): "o", (576, 3072): "gate_up", (1536, 576): "down"}


def bucket(tokens: int) -> str:
    for top in (1, 8, 32, 128, 512):
        if tokens <= top:
            return f"<={top}"
    return ">512"


class Timers:
    def __init__(self):
        self.seconds = defaultdict(float)
        self.flops = defaultdict(float)
        self.calls = defaultdict(int)
        self.wrapped: list[tuple[object, str, object]] = []

    def wrap(self, obj, attr: str, key, flops=None):
        """Replace obj.attr by a timed call; `key` is a name or a function of the call's arguments."""
        inner = getattr(obj, attr)
        self.wrapped.append((obj, attr, obj.__dict__.get(attr)))

        def timed(*args, **kwargs):
            t = time.perf_counter()
            out = inner(*args, **kwargs)
            dt = time.perf_counter() - t
            k = key(*args) if callable(key) else key
            self.seconds[k] += dt
            self.calls[k] += 1
            if flops is not None:
                self.flops[k] += flops(*args)
            return out

        setattr(obj, attr, timed)

    def restore(self) -> None:
        """Undo every wrap (the CpuLinear class is shared by the next run's engine)."""
        for obj, attr, before in reversed(self.wrapped):
            if before is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, before)


def instrument(llm: LLM) -> Timers:
    tm = Timers()
    engine = llm.engine
    runner = engine.runner
    model = runner.model

    def linear_key(self, x):
        path = "gemv" if x.shape[0] <= self.gemv_max else ("onednn" if self.packed is not None else "mkl")
        shape = SHAPE_NAMES.get((self.in_features, self.out_features), "lm_head")
        return f"matmul {shape} {path} {bucket(x.shape[0])}"

    tm.wrap(CpuLinear, "forward", linear_key, flops=lambda self, x: 2.0 * x.shape[0] * self.in_features
            * self.out_features)
    tm.wrap(model, "_fused_decode", "fused decode layers")
    backend = model.attn_backend
    tm.wrap(backend, "_prefill", "attention prefill")
    tm.wrap(backend, "_decode", "attention decode")
    tm.wrap(backend, "_write_kv", "kv write")
    for op in ("rms_norm", "add_rms_norm", "silu_mul", "rope"):
        tm.wrap(model.ops, op, "norms/rope/activation")
    tm.wrap(runner, "sampler", "sampling")
    tm.wrap(model, "forward", "model")
    tm.wrap(runner, "execute", "runner")
    tm.wrap(engine, "step", "step")
    return tm


def run(dtype: str, timed: bool) -> dict:
    llm = LLM(None, dtype=dtype, max_num_seqs=64, kv_cache_gib=2.0)
    reqs = workload(64)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], [SamplingParams(temperature=0, max_tokens=4)], use_tqdm=False)
    tm = instrument(llm) if timed else None
    t = time.perf_counter()
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        if tm is not None:
            tm.restore()
    wall = time.perf_counter() - t
    out = {"wall_s": wall, "output_tok_s": sum(m for _, m in reqs) / wall}
    if tm is not None:
        s = dict(tm.seconds)
        inner = sum(v for k, v in s.items() if k not in ("model", "runner", "step", "sampling"))
        rows = {k: v for k, v in s.items() if k not in ("model", "runner", "step")}
        rows["model other"] = s["model"] - inner
        rows["runner other"] = s["runner"] - s["model"] - s.get("sampling", 0.0)
        rows["engine other"] = wall - s["runner"]
        out["steps"] = tm.calls["step"]
        out["seconds"] = dict(sorted(rows.items(), key=lambda kv: -kv[1]))
        out["gflops"] = {k: tm.flops[k] / s[k] / 1e9 for k in tm.flops if s[k] > 0}
        out["calls"] = dict(tm.calls)
    llm.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--name", default="step_breakdown")
    args = ap.parse_args()
    result, lines = {}, []
    for dtype in args.dtypes.split(","):
        plain = run(dtype, timed=False)
        timed = run(dtype, timed=True)
        timed["overhead"] = timed["wall_s"] / plain["wall_s"] - 1
        timed["untimed_output_tok_s"] = plain["output_tok_s"]
        result[dtype] = timed
        print(f"{dtype}: {plain['output_tok_s']:.0f} tok/s untimed, {timed['output_tok_s']:.0f} timed "
              f"({timed['steps']} steps)")
        matmul = sum(v for k, v in timed["seconds"].items() if k.startswith("matmul"))
        for k, v in timed["seconds"].items():
            g = timed["gflops"].get(k)
            print(f"  {k:40s} {v:7.2f} s {v / timed['wall_s']:6.1%}" + (f"  {g:6.1f} GFLOP/s" if g else ""))
        lines.append(f"{dtype} matmuls {matmul / timed['wall_s']:.0%} of the wall, "
                     f"{timed['seconds'].get('engine other', 0) / timed['wall_s']:.0%} outside the runner")
    print(json.dumps({k: v["seconds"] for k, v in result.items()}, indent=1)[:400])
    save(args.name, result, "where a step's time goes (reference workload); " + "; ".join(lines))


if __name__ == "__main__":
    main()
