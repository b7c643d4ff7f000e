"""`conveyor profile`: measure the real engine on this machine and fit the simulator's cost model.

Sweeps steps of chosen shapes through the engine's own ModelRunner (the executor the engine
uses): prefill chunks of several sizes after several cached-context lengths, decode batches of
1..max_num_seqs sequences at several context lengths, mixed steps (a chunk beside decodes), and
swap copies of N blocks. Each shape runs once to warm up, then ``repeats`` times; the median
counts. The engine's own per-step work outside the executor (scheduling, updating requests,
detokenizing) is measured on a short real run and added. The StepCostModel of cost.py (a
piecewise-linear cost over the step's token count, plus costs per KV token read, per prefill
query-key pair and per sampled sequence) is then fitted by least squares on relative error,
with non-negative coefficients, and saved as JSON with the machine and model it came from.
"""

from __future__ import annotations

import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np
import torch
from tqdm import tqdm

from conveyor.engine.engine import Engine
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler.costs import StepCostModel, StepShape, hat_weights
from conveyor.scheduler.output import NewRequestData, ScheduledSeq, SchedulerOutput

GREEDY = SamplingParams(temperature=0, max_tokens=1 << 20)


@dataclass(slots=True)
class Sample:
    kind: str
    shape: StepShape
    seconds: float


def machine() -> dict:
    """CPU model and the flags that decide its kernels, torch and its threads, and the kernel paths
    this machine's probes chose (conveyor/model/probe_cache.py; empty before the first engine start)."""
    from conveyor.model.probe_cache import KEY_FLAGS, cpu_family, cpu_info, decisions

    model, flags = cpu_info()
    return {"cpu": model if model != "unknown" else platform.processor() or platform.machine(),
            "cpu_family": cpu_family(),
            "flags": [f for f in KEY_FLAGS if f in flags], "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "paths": decisions()["decisions"]}


class _Plans:
    """Synthetic plans over the runner's KV cache: distinct blocks per sequence, wrapping around.
    Every sequence is new to the runner (so a plan can be executed again and again), and each
    plan tells the runner to forget the previous plan's."""

    def __init__(self, engine: Engine, seed: int = 0):
        self.block_size = engine.config.block_size
        self.num_blocks = engine.runner.kv.num_blocks
        # A hybrid KV cache (layer groups, e.g. Gemma 3's local and global layers): a table holds one
        # block per group for each block of tokens, interleaved, as the scheduler's KV manager builds it.
        layout = engine.runner.layout
        self.groups = layout.num_groups if layout is not None else 1
        self.vocab = engine.model_config.vocab_size
        self.rng = random.Random(seed)
        self.next_block = 0
        self.n = 0
        self.previous: list[str] = []

    @property
    def capacity(self) -> int:
        return self.num_blocks // self.groups * self.block_size

    def seq(self, computed: int, num_tokens: int, sample: bool = True) -> ScheduledSeq:
        blocks = -(-(computed + num_tokens) // self.block_size) * self.groups
        table = [(self.next_block + i) % self.num_blocks for i in range(blocks)]
        self.next_block = (self.next_block + blocks) % self.num_blocks
        self.n += 1
        tokens = [self.rng.randrange(self.vocab) for _ in range(num_tokens)]
        return ScheduledSeq(f"p{self.n}", tokens, computed, table, NewRequestData(GREEDY, 0, 0), sample=sample)

    def plan(self, seqs: list[ScheduledSeq]) -> SchedulerOutput:
        out = SchedulerOutput(0, seqs, forget_ids=self.previous)
        self.previous = [s.request_id for s in seqs]
        for s in seqs:
            if s.num_tokens == 1 and s.num_computed_tokens > 0:
                out.num_decode_tokens += 1
            else:
                out.num_prefill_tokens += s.num_tokens
        return out


def _time(fn: Callable[[], object], repeats: int) -> float:
    fn()   # warm-up: kernels built, allocator primed
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def step_shapes(engine: Engine, quick: bool = False) -> list[tuple[str, Callable[[_Plans], list[ScheduledSeq]]]]:
    """(kind, builder) of every step the sweep measures."""
    cap = min(engine.max_model_len, 2048)
    max_seqs = engine.config.scheduler.max_num_seqs
    kv_tokens = _Plans(engine).capacity   # tokens of distinct KV (per layer group)
    chunks = (32, 256) if quick else (16, 64, 256, 512)
    cached = (0, 512) if quick else (0, 256, 1024, 1536)
    candidates = (1, 8, 32) if quick else (1, 2, 4, 8, 16, 32, 64, 128, max_seqs)
    # Knots on both sides of every kernel switch (e.g. GEMV up to 8 tokens, oneDNN from 9).
    switches = [t for k, n in dispatch_thresholds(engine).items() if k.endswith("_tokens") for t in (n, n + 1)]
    batches = sorted({b for b in (*candidates, *switches) if 1 <= b <= max_seqs})
    contexts = (64, 512) if quick else (32, 128, 512, 1024)
    out: list = []
    for n in chunks:
        for c in cached:
            if c + n <= cap:
                out.append(("prefill", lambda p, n=n, c=c: [p.seq(c, n)]))
    for b in batches:
        for ctx in contexts:
            if ctx < cap and b * (ctx + 1) <= kv_tokens:   # distinct blocks: no sequence shares KV memory
                out.append(("decode", lambda p, b=b, ctx=ctx: [p.seq(ctx, 1) for _ in range(b)]))
    for n, b, ctx in ((64, 8, 256), (256, 32, 256)) if not quick else ((64, 8, 256),):
        if b <= max_seqs and b * (ctx + 1) + n <= kv_tokens:
            out.append(("mixed", lambda p, n=n, b=b, ctx=ctx: [p.seq(0, n)] + [p.seq(ctx, 1) for _ in range(b)]))
    # A full budget of prompt chunks (several prefills in one step), the largest step the engine takes.
    budget = engine.config.scheduler.max_num_batched_tokens
    chunk = engine.config.scheduler.prefill_chunk_cap
    if not quick and budget > chunk and budget <= kv_tokens:
        k = budget // chunk
        out.append(("prefills", lambda p, k=k, chunk=chunk: [p.seq(0, chunk) for _ in range(k)]))
    return out


def dispatch_thresholds(engine: Engine) -> dict[str, int]:
    """The token counts where the engine's model switches kernel paths (empty where it has none,
    e.g. off the CPU or without the C++ kernels)."""
    thresholds = getattr(engine.runner.model, "dispatch_thresholds", None)
    return thresholds() if thresholds is not None else {}


def measure_engine_overhead(engine: Engine, batch: int, steps: int = 12) -> float:
    """Median seconds per step the engine spends outside the executor (decode steps of `batch` requests)."""
    runner = engine.core.executor
    inside = [0.0]

    class Timed:
        def swap(self, swap_out, swap_in):
            runner.swap(swap_out, swap_in)

        def execute(self, plan):
            t = time.perf_counter()
            try:
                return runner.execute(plan)
            finally:
                inside[0] += time.perf_counter() - t

    engine.core.executor = Timed()
    try:
        vocab = engine.model_config.vocab_size
        for i in range(batch):
            engine.add_request([(100 + i * 7 + j) % vocab for j in range(8)],
                               SamplingParams(temperature=0, max_tokens=steps + 3, ignore_eos=True))
        overheads = []
        while engine.has_unfinished_requests():
            inside[0] = 0.0
            t = time.perf_counter()
            engine.step()
            overheads.append(time.perf_counter() - t - inside[0])
    finally:
        engine.core.executor = runner
    return statistics.median(overheads[2:])


EXTRA = ("decode_context", "prefill_attention", "sampled")


def fit(samples: list[Sample]) -> tuple[StepCostModel, dict]:
    """Least squares on relative error (each sample weighted by 1 / its time). The unknowns: the
    curve's value at every measured token count, and the extra features' costs; an extra whose
    cost comes out negative is dropped (set to 0) and the rest refitted."""
    knots = sorted({s.shape.tokens for s in samples})
    x = np.array([hat_weights(knots, s.shape.tokens) + [getattr(s.shape, "num_sampled" if f == "sampled" else f)
                                                        for f in EXTRA] for s in samples], dtype=np.float64)
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    w = 1.0 / y
    active = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        extra_neg = [(c, i) for c, i in zip(coef, active) if i >= len(knots) and c < 0]
        if not extra_neg:
            break
        active.remove(min(extra_neg)[1])
    full = np.zeros(x.shape[1])
    full[active] = np.maximum(coef, 0)
    n = len(knots)
    model = StepCostModel(knots, full[:n].tolist(), decode_context=float(full[n]), prefill_attention=float(full[n + 1]),
                          sampled=float(full[n + 2]), seq=0.0)
    rel = np.abs(x @ full - y) / y
    quality = {"samples": len(samples), "mean_abs_rel_error": float(rel.mean()), "max_abs_rel_error": float(rel.max()),
               "dropped": [EXTRA[i - n] for i in range(n, x.shape[1]) if i not in active]}
    return model, quality


def profile(engine: Engine, *, quick: bool = False, repeats: int = 3, progress: bool = True) -> StepCostModel:
    plans = _Plans(engine)
    runner = engine.runner
    shapes = step_shapes(engine, quick)
    samples: list[Sample] = []
    swap_sizes = (8, 64) if quick else (8, 32, 128)
    bar = tqdm(total=len(shapes) + len(swap_sizes) + 2, desc="profiling", unit="shape", disable=not progress)
    for kind, build in shapes:
        seqs = build(plans)
        plan = plans.plan(seqs)
        samples.append(Sample(kind, StepShape.of(plan), _time(lambda: runner.execute(plan), repeats)))
        bar.update(1)
    swap_per_block = []
    host_blocks = runner.host.num_blocks
    for n in swap_sizes:
        n = min(n, host_blocks, runner.kv.num_blocks)
        mapping = [(i, i) for i in range(n)]
        swap_per_block.append(_time(lambda: runner.swap(mapping, []), repeats) / n)
        swap_per_block.append(_time(lambda: runner.swap([], mapping), repeats) / n)
        bar.update(1)
    executor_only, quality = fit(samples)
    # The engine's own per-step work outside the executor: a fixed part and a part per sequence.
    small = measure_engine_overhead(engine, 1)
    bar.update(1)
    batch = min(32, engine.config.scheduler.max_num_seqs)
    large = measure_engine_overhead(engine, batch)
    bar.update(1)
    bar.close()
    per_seq = max(0.0, (large - small) / max(1, batch - 1))
    fixed = max(0.0, small - per_seq)
    cfg = engine.config
    model = StepCostModel(executor_only.knots, [c + fixed for c in executor_only.knot_costs],
                          executor_only.decode_context, executor_only.prefill_attention, executor_only.sampled,
                          per_seq, swap_block=statistics.median(swap_per_block),
                          kv_bytes_per_token=engine.model_config.kv_bytes_per_token(getattr(torch, engine.dtype).itemsize))
    model.meta = {
        "machine": machine(), "model": engine.model_name, "dtype": engine.dtype, "block_size": cfg.block_size,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "fit": quality,
        "dispatch_thresholds": dispatch_thresholds(engine),
        "engine_overhead_s": {"batch_1": small, f"batch_{batch}": large},
        "samples": [{"kind": s.kind, "measured_s": s.seconds, "fitted_s": executor_only.shape_time(s.shape),
                     "tokens": s.shape.tokens, "decode_context": s.shape.decode_context,
                     "prefill_attention": s.shape.prefill_attention, "sampled": s.shape.num_sampled}
                    for s in samples]}
    return model
