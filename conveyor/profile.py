"""`conveyor profile`: measure the real engine on this machine and fit the simulator's cost model.

Sweeps steps of chosen shapes through the engine's own ModelRunner (the executor the engine
uses): prefill chunks of several sizes after several cached-context lengths, decode batches of
1..max_num_seqs sequences at several context lengths, mixed steps (a chunk beside decodes), and
swap copies of N blocks. Each shape runs once to warm up, then ``repeats`` times or more (0.1 s),
in several sweeps; the median counts. The decode steps after a prefill chunk are measured apart
(they read weights the chunk evicted from the caches). The engine's own per-step work outside the
executor (scheduling, updating requests, detokenizing) is measured on a short real run and added. The StepCostModel of cost.py (a
piecewise-linear cost over the step's token count, plus costs per KV token read (one per
number of sequences decoding), per prefill
query-key pair and per sampled sequence) is then fitted by least squares on relative error,
with non-negative coefficients, and saved as JSON with the machine and model it came from.
"""

from __future__ import annotations

import math
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from conveyor.engine.engine import Engine
from conveyor.model.cpu_kernels import kernels_digest
from conveyor.model.probe_cache import KEY_FLAGS, cpu_family, cpu_info, decisions
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler.costs import StepCostModel, StepShape, flat_hat_weights, hat_weights
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
    model, flags = cpu_info()
    return {"cpu": model if model != "unknown" else platform.processor() or platform.machine(),
            "cpu_family": cpu_family(),
            "flags": [f for f in KEY_FLAGS if f in flags], "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "paths": decisions()["decisions"],
            # The kernels built and chosen as on a CPU with only these flags (probe_cache.cpu_info).
            **({"flags_restricted_to": os.environ["CONVEYOR_CPU_FLAGS"]} if "CONVEYOR_CPU_FLAGS" in os.environ else {})}


class _Plans:
    """Synthetic plans over the runner's KV cache: distinct blocks per sequence, wrapping around.
    Every sequence is new to the runner (so a plan can be executed again and again), and each
    plan tells the runner to forget the previous plan's. The blocks are taken in a shuffled order
    (`scattered`, the default) of runs of `run` consecutive blocks (default: the blocks of one
    prompt chunk, ``prefill_chunk_cap`` tokens, as the engine's scheduler allocates a chunk's from
    its free queue; 1: every block on its own). A serving engine's tables are not one run of
    consecutive blocks once requests have come and gone, and on the Zen4 a decode step reading
    1,024 tokens of context per sequence from blocks scattered one by one took 1.3-1.6x as long as
    from consecutive ones (the profile's tables until 2026-12-06), which priced long prompts' decode
    steps 15-44% short; since the attention kernel's L2 prefetch 1.1-1.3x (benchmarks/kv_scatter.py),
    and blocks scattered one by one then priced the engine's 1-4-sequence decode steps over 1,024
    tokens of context 14-26% high (runs of a chunk's 16 blocks: 0.82-0.85x of one by one there)."""

    def __init__(self, engine: Engine, seed: int = 0, prefix: str = "p", scattered: bool = True,
                 run: int | None = None):
        self.block_size = engine.config.block_size
        self.num_blocks = engine.runner.kv.num_blocks
        # A hybrid KV cache (layer groups, e.g. Gemma 3's local and global layers): a table holds one
        # block per group for each block of tokens, interleaved, as the scheduler's KV manager builds it.
        layout = engine.runner.layout
        self.groups = layout.num_groups if layout is not None else 1
        self.order = list(range(self.num_blocks))
        if scattered:
            if run is None:
                run = max(1, engine.config.scheduler.prefill_chunk_cap // self.block_size) * self.groups
            runs = [self.order[i:i + run] for i in range(0, self.num_blocks, run)]
            random.Random(seed + 1).shuffle(runs)
            self.order = [b for r in runs for b in r]
        self.vocab = engine.model_config.vocab_size
        self.rng = random.Random(seed)
        self.next_block = 0
        self.n = 0
        self.prefix = prefix
        self.previous: list[str] = []

    @property
    def capacity(self) -> int:
        return self.num_blocks // self.groups * self.block_size

    def seq(self, computed: int, num_tokens: int, sample: bool = True) -> ScheduledSeq:
        blocks = -(-(computed + num_tokens) // self.block_size) * self.groups
        table = [self.order[(self.next_block + i) % self.num_blocks] for i in range(blocks)]
        self.next_block = (self.next_block + blocks) % self.num_blocks
        self.n += 1
        tokens = [self.rng.randrange(self.vocab) for _ in range(num_tokens)]
        return ScheduledSeq(f"{self.prefix}{self.n}", tokens, computed, table, NewRequestData(GREEDY, 0, 0), sample=sample)

    def plan(self, seqs: list[ScheduledSeq]) -> SchedulerOutput:
        out = SchedulerOutput(0, seqs, forget_ids=self.previous)
        self.previous = [s.request_id for s in seqs]
        for s in seqs:
            if s.num_tokens == 1 and s.num_computed_tokens > 0:
                out.num_decode_tokens += 1
            else:
                out.num_prefill_tokens += s.num_tokens
        return out


MIN_SECONDS = 0.1   # a shape is timed at least this long (short steps more than `repeats` times)
MAX_REPEATS = 40


def _time(fn: Callable[[], object], repeats: int, min_seconds: float = 0.0) -> float:
    """Median seconds of `fn` over `repeats` runs after a warm-up, or more runs (up to MAX_REPEATS)
    until `min_seconds` have passed: a 4 ms decode step timed 3 times varied by 20-30% from one
    measurement to the next on a shared 2-vCPU machine."""
    fn()   # warm-up: kernels built, allocator primed
    times = []
    start = time.perf_counter()
    while len(times) < repeats or (time.perf_counter() - start < min_seconds and len(times) < MAX_REPEATS):
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
    # Every count up to 8: the quantized kernels' passes take 1-8 tokens each with its own code
    # (1.2-1.5 ms more per token from 2 to 8 on the demo model; between knots 4 and 8 a line was 5% off).
    candidates = (1, 8, 32) if quick else (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128, max_seqs)
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


AFTER_PREFILL_TOKENS = (16, 64, 256)
AFTER_PREFILL_MAX = 1024
AFTER_PREFILL_STEPS = 16


def measure_after_prefill(engine: Engine, plans: _Plans, prefill_tokens: int, repeats: int = 6,
                          steps: int = AFTER_PREFILL_STEPS) -> list[float] | None:
    """Extra seconds of each of the first `steps` decode steps (one sequence, 128 tokens of context)
    after a prefill chunk of `prefill_tokens`, against the same step warm (the median of the 8 steps
    after those); from the first step within 3% of warm on, 0 (noise). None where it does not fit."""
    if prefill_tokens > min(engine.max_model_len, plans.capacity - 129):
        return None
    runner = engine.runner
    chunk, decode = [plans.seq(0, prefill_tokens)], [plans.seq(128, 1)]
    times: list[list[float]] = [[] for _ in range(steps + 8)]
    runner.execute(plans.plan(chunk))   # warm-up
    for _ in range(repeats):
        runner.execute(plans.plan(chunk))
        for k in range(steps + 8):
            plan = plans.plan(decode)
            t = time.perf_counter()
            runner.execute(plan)
            times[k].append(time.perf_counter() - t)
    warm = statistics.median(x for k in range(steps, steps + 8) for x in times[k])
    extra = [max(0.0, statistics.median(times[k]) - warm) for k in range(steps)]
    settled = next((k for k, e in enumerate(extra) if e <= 0.03 * warm), steps)
    return extra[:settled] + [0.0] * (steps - settled)


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


# A speed check: a few of the profile's own step shapes (kind, tokens, context), timed again later and
# compared with what the profile's fit prices them at (``meta.probe_fit``; their times when the
# profile was taken are ``meta.probe``). A shared machine's speed drifts by ~10% from one minute to
# the next (docs/simulator.md), and a capacity plan or a validation priced at the profile's speed
# carries that error, amplified by the queue near saturation.
WARM_UP_SECONDS = 1.0
PROBE = (("decode", 1, 128), ("decode", 8, 128), ("decode", 32, 128), ("prefill", 256, 0))


def probe_label(kind: str, n: int, ctx: int) -> str:
    """A probe step's name in ``meta.probe`` and the checks: ``decode 8@128``, ``prefill 256@0``."""
    return f"{kind} {n}@{ctx}"


def probe_by_tokens(per_probe: dict[str, float]) -> dict[int, float]:
    """Values by probe label (``decode 8@128``) keyed by the probe step's token count instead (8)."""
    return {n: per_probe[label] for kind, n, ctx in PROBE if (label := probe_label(kind, n, ctx)) in per_probe}


def _probe_seqs(engine: Engine, plans: _Plans) -> dict[str, list[ScheduledSeq]]:
    """The sequences of each ``PROBE`` step that fits this engine's batch and KV cache, by label."""
    built = {}
    for kind, n, ctx in PROBE:
        if kind == "decode":
            if n > engine.config.scheduler.max_num_seqs or n * (ctx + 1) > plans.capacity:
                continue
            seqs = [plans.seq(ctx, 1) for _ in range(n)]
        else:
            if ctx + n > min(engine.max_model_len, plans.capacity):
                continue
            seqs = [plans.seq(ctx, n)]
        built[probe_label(kind, n, ctx)] = seqs
    return built


def probe_shapes(engine: Engine) -> dict[str, StepShape]:
    """The shape of each probe step `probe_times` times on this engine, by label."""
    plans = _Plans(engine, seed=1, prefix="probe-")
    return {label: StepShape.of(plans.plan(seqs)) for label, seqs in _probe_seqs(engine, plans).items()}


def probe_reference(cost: StepCostModel) -> dict[str, float]:
    """What a speed check compares each probe step's time of now with: the profile's fit at the
    probe's shape (``meta.probe_fit``; in a profile saved before it, the fitted time of its sample of
    that shape, times the factors of the ``--rescale``s since), else the probe's own time when
    profiled (``meta.probe``).

    Why the fit: the check's factor scales the fitted model, so it must say how far the machine is
    now from what the model prices, not from one moment of the profile. The probes are timed at the
    profile's end, minutes after its samples, and on the Zen4 VM the two disagreed at the same shape
    by up to 34% (a 256-token chunk 1.34x the fit; batch 8 1.28x, batch 1 0.82x in other profiles); a
    check against the probe times carried that error into every factor (over the same runs the step
    cost followed the factors to the power 0.68 at one thread, 0.27 at two; against the fit 0.81 and
    0.45: docs/simulator.md)."""
    meta = cost.meta
    probe = meta.get("probe") or {}
    fit = dict(meta.get("probe_fit") or {})
    rescaled = math.prod(c["factor"] for c in meta.get("speed_checks", []))   # on the model, not its samples
    for label in probe.keys() - fit.keys():
        kind, at = label.split(" ", 1)
        n, ctx = map(int, at.split("@"))
        for s in meta.get("samples", []):
            same = (s["decode_context"] == n * (ctx + 1) if kind == "decode"
                    else s["prefill_attention"] == n * (ctx + (n + 1) / 2))
            if s["kind"] == kind and s["tokens"] == n and same:
                fit[label] = s["fitted_s"] * rescaled
                break
    return {label: fit.get(label, t) for label, t in probe.items()}


def probe_times(engine: Engine, repeats: int = 5) -> dict[str, float]:
    """Median seconds of each ``PROBE`` step that fits this engine's batch and KV cache, by label
    (``decode 8@128``: 8 sequences at 128 tokens of context; ``prefill 256@0``: a 256-token chunk).
    For an idle engine: like the profile, the probe writes KV into any block, so it also forgets the
    prefix cache."""
    plans = _Plans(engine, seed=1, prefix="probe-")
    runner = engine.runner
    built = _probe_seqs(engine, plans)
    # Warm up first: in a fresh process the first 0.1-0.3 s of steps ran up to 1.5x slower (batch 1
    # decoding 5.3 instead of 3.5 ms), more than one warm-up step absorbs.
    start = time.perf_counter()
    while time.perf_counter() - start < WARM_UP_SECONDS:
        for seqs in built.values():
            runner.execute(plans.plan(seqs))
    out = {}
    for name, seqs in built.items():
        plan = plans.plan(seqs)
        out[name] = _time(lambda: runner.execute(plan), repeats, MIN_SECONDS)
    engine.core.scheduler.kv.reset_prefix_cache()
    return out


def speed_check(engine: Engine, cost: StepCostModel, repeats: int = 5, rounds: int = 3) -> dict:
    """How much slower (> 1) or faster this machine runs the profile's probe steps now than `cost`
    prices them (`probe_reference`): per probe and their median (``factor``, what
    ``StepCostModel.scaled`` takes). The probes are timed `rounds` times in a row (each round after its
    own second of warm-up) and each probe's time is its median over the rounds; ``rounds_s`` keeps
    every round's times. Why three: on the Zen4 VM a batch-1 probe's time moved by up to 1.41x (median
    1.13x) between the rounds of one check, seconds apart, and in one benchmark run (sim_calibration
    run 14) the profile scaled by the median of three rounds met every latency target in 10 of 10
    cells, by any single round's 5, 9 and 8. A profile saved before probes were recorded has none:
    ``factor`` is then None."""
    then = probe_reference(cost)
    each = [probe_times(engine, repeats) for _ in range(rounds)]
    now = {k: statistics.median(r[k] for r in each) for k in each[0]}
    ratios = {k: now[k] / then[k] for k in now if then.get(k)}
    # The same ratios by the probe step's token count (small memory-bound steps and large compute-bound ones
    # drift apart): `StepCostModel.scaled(factor, by_tokens)` interpolates them over the step-cost curve.
    # `--rescale` and sim_calibration's "checked" model scale by size (`--rescale-by median`: the median).
    return {"now_s": now, "then_s": then, "ratios": ratios, "by_tokens": probe_by_tokens(ratios),
            "factor": statistics.median(ratios.values()) if ratios else None, "rounds_s": each}


def recheck_profile(engine: Engine, path, rescale: bool = False, by_size: bool = True) -> dict:
    """``conveyor profile --recheck [--rescale [--rescale-by size|median]]``: the speed check of the
    profile saved at `path`; with `rescale`, the profile saved again scaled by what it found (with
    `by_size`, the default as ``--rescale``'s, by each probe's ratio over the step-cost curve by size,
    ``StepCostModel.scaled``; else by their median), with the probe times of now, the scaled fit's
    prices of the probes (what the next check compares with: each reference times the factor the
    scaled model applies at that probe's shape) and the check's date and factors in
    ``meta.speed_checks``."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no profile at {path}: run `conveyor profile` first")
    cost = StepCostModel.load(path)
    check = speed_check(engine, cost)
    if check["factor"] is None:
        raise ValueError(f"{path} has no probe times to compare with (saved before speed checks, or measured "
                         "on a smaller engine): run `conveyor profile` again")
    check["profiled"] = cost.meta.get("date", "date unknown")
    if rescale:
        scaled = cost.scaled(check["factor"], check["by_tokens"] if by_size else None)
        shapes = probe_shapes(engine)
        scaled.meta["probe"] = check["now_s"]
        scaled.meta["probe_fit"] = {
            k: t * (scaled.shape_time(shapes[k]) / cost.shape_time(shapes[k]) if k in shapes else check["factor"])
            for k, t in check["then_s"].items()}
        logged = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "factor": check["factor"]}
        if by_size:
            logged["by_tokens"] = check["by_tokens"]
        scaled.meta["speed_checks"] = [*cost.meta.get("speed_checks", []), logged]
        scaled.save(path)
    return check


EXTRA = ("prefill_attention", "sampled")


def _identifiable(x: np.ndarray, first_extra: int) -> list[int]:
    """The columns to fit: all knots, and each extra column (from `first_extra` on) that the others do
    not already span. A sweep that samples every token count with one count of sampled sequences (the
    quick profile's) cannot tell a sampled sequence's cost from the knots': least squares then picks the
    smallest-norm split, which moved the decode knots below zero (clipped, and the fit was 60% off)."""
    unit = x / np.maximum(np.linalg.norm(x, axis=0), 1e-300)
    active = list(range(x.shape[1]))
    rank = np.linalg.matrix_rank(unit)
    for i in reversed(range(first_extra, x.shape[1])):
        rest = [j for j in active if j != i]
        if np.linalg.matrix_rank(unit[:, rest]) == rank:
            active = rest
    return active


def fit(samples: list[Sample]) -> tuple[StepCostModel, dict]:
    """Least squares on relative error (each sample weighted by 1 / its time). The unknowns: the
    curve's value at every measured token count, the cost per KV token the decodes read at every
    measured count of decoding sequences (``context_slopes``: one sequence reads its KV at 1.5x the
    cost per token of 32, and one slope for all priced batch-1 steps up to 6% high at short contexts
    and 9% low at 1024), and the extra features' costs; a cost that comes out negative is dropped
    (set to 0) and the rest refitted.
    ``decode_context`` is the median slope (a summary; the step's price uses the slopes)."""
    knots = sorted({s.shape.tokens for s in samples})
    batches = sorted({s.shape.decode_tokens for s in samples if s.shape.decode_tokens and not s.shape.prefill_tokens})

    def context_columns(shape: StepShape) -> list[float]:
        if not shape.decode_tokens or not batches:
            return [0.0] * len(batches)
        return [w * shape.decode_context for w in flat_hat_weights(batches, shape.decode_tokens)]

    x = np.array([hat_weights(knots, s.shape.tokens) + context_columns(s.shape)
                  + [getattr(s.shape, "num_sampled" if f == "sampled" else f) for f in EXTRA] for s in samples],
                 dtype=np.float64)
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    w = 1.0 / y
    n, m = len(knots), len(batches)
    active = _identifiable(x * w[:, None], n)
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        extra_neg = [(c, i) for c, i in zip(coef, active) if i >= n and c < 0]
        if not extra_neg:
            break
        active.remove(min(extra_neg)[1])
    full = np.zeros(x.shape[1])
    full[active] = np.maximum(coef, 0)
    slopes = full[n:n + m].tolist()
    model = StepCostModel(knots, full[:n].tolist(), decode_context=float(np.median(slopes)) if slopes else 0.0,
                          prefill_attention=float(full[n + m]), sampled=float(full[n + m + 1]), seq=0.0,
                          context_batches=batches, context_slopes=slopes)
    rel = np.abs(x @ full - y) / y
    names = [f"decode_context@{b}" for b in batches] + list(EXTRA)
    quality = {"samples": len(samples), "mean_abs_rel_error": float(rel.mean()), "max_abs_rel_error": float(rel.max()),
               "dropped": [names[i - n] for i in range(n, x.shape[1]) if i not in active]}
    return model, quality


def profile(engine: Engine, *, quick: bool = False, repeats: int = 3, passes: int | None = None,
            progress: bool = True) -> StepCostModel:
    """Measure and fit. Every shape is timed in each of `passes` sweeps (default 3, 1 with `quick`;
    odd sweeps in reverse order) and its median over the sweeps counts: a shared machine's speed
    drifts within a minute, and one sweep put a shape's cost wherever the machine was at that moment
    (two profiles taken minutes apart differed by up to 15% on a knot, batch 1 decoding slower than
    batch 2)."""
    plans = _Plans(engine)
    runner = engine.runner
    shapes = step_shapes(engine, quick)
    passes = passes or (1 if quick else 3)
    min_seconds = 0.0 if quick else MIN_SECONDS
    swap_sizes = (8, 64) if quick else (8, 32, 128)
    # The decode steps after chunks of AFTER_PREFILL_TOKENS and after one as large as the step budget (up to
    # AFTER_PREFILL_MAX): long prompts' decode steps mostly follow such chunks.
    budget = min(engine.config.scheduler.max_num_batched_tokens, AFTER_PREFILL_MAX)
    transitions = (64,) if quick else sorted({*AFTER_PREFILL_TOKENS, max(budget, AFTER_PREFILL_TOKENS[0])})
    bar = tqdm(total=passes * len(shapes) + len(transitions) + len(swap_sizes) + 3, desc="profiling",
               unit="shape", disable=not progress)
    measured: list[list[float]] = [[] for _ in shapes]
    kept: list[StepShape | None] = [None] * len(shapes)
    for sweep in range(passes):
        order = range(len(shapes)) if sweep % 2 == 0 else reversed(range(len(shapes)))
        for i in order:
            plan = plans.plan(shapes[i][1](plans))
            kept[i] = StepShape.of(plan)
            measured[i].append(_time(lambda: runner.execute(plan), repeats, min_seconds))
            bar.update(1)
    samples = [Sample(kind, shape, statistics.median(times))
               for (kind, _), shape, times in zip(shapes, kept, measured)]
    after_prefill = {}   # prefill tokens -> extra seconds of the decode steps after such a chunk
    for n in transitions:
        curve = measure_after_prefill(engine, plans, n, repeats=2 if quick else 6)
        if curve is not None:
            after_prefill[n] = curve
        bar.update(1)
    swap_per_block = []
    host_blocks = runner.host.num_blocks
    for n in swap_sizes:
        n = min(n, host_blocks, runner.kv.num_blocks)
        mapping = [(i, i) for i in range(n)]
        swap_per_block.append(_time(lambda: runner.swap(mapping, []), repeats, min_seconds) / n)
        swap_per_block.append(_time(lambda: runner.swap([], mapping), repeats, min_seconds) / n)
        bar.update(1)
    executor_only, quality = fit(samples)
    # The engine's own per-step work outside the executor: a fixed part and a part per sequence.
    small = measure_engine_overhead(engine, 1)
    bar.update(1)
    batch = min(32, engine.config.scheduler.max_num_seqs)
    large = measure_engine_overhead(engine, batch)
    bar.update(1)
    probe = probe_times(engine)   # later speed checks time these steps again
    probe_fit = {label: executor_only.shape_time(shape) for label, shape in probe_shapes(engine).items()}
    bar.update(1)
    bar.close()
    per_seq = max(0.0, (large - small) / max(1, batch - 1))
    fixed = max(0.0, small - per_seq)
    cfg = engine.config
    model = StepCostModel(executor_only.knots, [c + fixed for c in executor_only.knot_costs],
                          executor_only.decode_context, executor_only.prefill_attention, executor_only.sampled,
                          per_seq, swap_block=statistics.median(swap_per_block),
                          context_batches=executor_only.context_batches,
                          context_slopes=executor_only.context_slopes,
                          after_prefill_tokens=sorted(after_prefill),
                          after_prefill=[after_prefill[n] for n in sorted(after_prefill)],
                          kv_bytes_per_token=engine.model_config.kv_bytes_per_token(getattr(torch, engine.dtype).itemsize))
    model.meta = {
        "machine": machine(), "model": engine.model_name, "dtype": engine.dtype, "block_size": cfg.block_size,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "fit": quality,
        "dispatch_thresholds": dispatch_thresholds(engine), "kernels": kernels_digest(),
        "engine_overhead_s": {"batch_1": small, f"batch_{batch}": large}, "probe": probe,
        "probe_fit": probe_fit,
        "samples": [{"kind": s.kind, "measured_s": s.seconds, "fitted_s": executor_only.shape_time(s.shape),
                     "tokens": s.shape.tokens, "decode_context": s.shape.decode_context,
                     "prefill_attention": s.shape.prefill_attention, "sampled": s.shape.num_sampled}
                    for s in samples]}
    return model
