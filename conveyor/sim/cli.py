"""`conveyor simulate`: the real scheduler on a cost model — throughput, latency, goodput,
preemptions and KV usage for a workload and a set of engine knobs; sweeps; capacity planning.

    conveyor simulate --rate 2 --num-requests 500 --prompt-len 32:512 --output-len lognormal:100:1:1024
    conveyor simulate --sweep max_num_seqs=16,32,64 --slo ttft_p99=2s,tpot_p50=100ms
    conveyor simulate --find-max-rate --slo ttft_p99=2s,tpot_p50=100ms
    conveyor simulate --gpu h200 --model llama-3.1-8b --rate 50 --find-replicas --slo ttft_p99=2s,tpot_p50=50ms
    conveyor simulate --max-num-seqs 4 --spec-acceptance 0.7 --spec-match-rate 0.8 \
        --sweep 'speculative_config=none,{"method":"ngram","num_speculative_tokens":5}'

No torch here: the cost model is a profile measured by `conveyor profile` (default: the one saved
for the demo model, else built-in numbers) or a roofline model of a named GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from conveyor.config import EngineConfig, add_engine_args, config_from_args, option_names
from conveyor.core.trace import StepTracer
from conveyor.paths import profile_path
from conveyor.routing import ALIASES, POLICIES
from conveyor.scheduler.costs import CostModel, StepCostModel
from conveyor.sim.roofline import GPUS, MODEL_PRESETS, RooflineCostModel, model_shape
from conveyor.sim.simulator import SENSITIVITY_METRICS, SENSITIVITY_STEP, SimResult, elasticity, simulate
from conveyor.sim.speculation import DEFAULT_ACCEPTANCE, DEFAULT_MATCH_RATE, SimSpeculation
from conveyor.sim.workload import WorkloadSpec, load_trace, parse_priorities, parse_tenants
from conveyor.spec.speculator import SpeculativeConfig

DEMO = "SmolLM2-135M-Instruct"
_WARNED: set[Path] = set()
UNITS = {"ms": 1e-3, "s": 1.0, "us": 1e-6}


def parse_slo(text: str) -> dict[str, float]:
    """'ttft_p99=2s,tpot_p50=100ms' -> {'ttft_p99': 2.0, 'tpot_p50': 0.1}."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, _, value = item.partition("=")
        metric, _, stat = name.partition("_")
        if metric not in ("ttft", "tpot", "e2e") or not (stat == "mean" or stat.lstrip("p").replace(".", "").isdigit()):
            raise ValueError(f"bad SLO term {item!r}: use ttft|tpot|e2e _pNN|_mean = value[ms|s]")
        unit = next((u for u in ("ms", "us", "s") if value.endswith(u)), "s")
        out[name] = float(value[: len(value) - len(unit)] if value.endswith(unit) else value) * UNITS[unit]
    if not out:
        raise ValueError("empty SLO")
    return out


# ---- what to simulate ----------------------------------------------------------------------------

class Setup:
    """A cost model, a KV cache size and the engine's knobs, from the command line."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.config: EngineConfig = config_from_args(args)
        self.tp = args.tensor_parallel
        self.cost, self.describe = self._cost_model()
        self.speculative = SpeculativeConfig.parse(self.config.speculative_config)
        self.speculation = SimSpeculation(
            args.spec_acceptance if args.spec_acceptance is not None else DEFAULT_ACCEPTANCE,
            args.spec_match_rate if args.spec_match_rate is not None else DEFAULT_MATCH_RATE, seed=args.seed)

    def _cost_model(self) -> tuple[CostModel, str]:
        a = self.args
        if a.gpu:
            eff = dict(compute=0.5, bandwidth=0.8, overhead_ms=0.5)
            for item in filter(None, (a.efficiency or "").split(",")):
                k, _, v = item.partition("=")
                if k not in eff:
                    raise ValueError(f"bad --efficiency term {item!r}: compute, bandwidth or overhead_ms")
                eff[k] = float(v)
            shape = model_shape(a.model or "smollm2-135m")
            cost = RooflineCostModel(GPUS[a.gpu], shape, tp=self.tp, compute_efficiency=eff["compute"],
                                     bandwidth_efficiency=eff["bandwidth"], step_overhead=eff["overhead_ms"] * 1e-3,
                                     block_size=self.config.block_size)
            return cost, (f"roofline model of {self.tp} x {cost.gpu.name} for {shape.name} "
                          f"(efficiency: compute {eff['compute']}, bandwidth {eff['bandwidth']}, "
                          f"{eff['overhead_ms']} ms per step)")
        spec = a.cost_model
        if spec == "auto":
            dtypes = ("bfloat16", "float32") if self.config.dtype == "auto" else (self.config.dtype,)
            paths = [profile_path(a.model or DEMO, d) for d in dtypes]
            path = next((p for p in paths if p.is_file()), paths[0])
            if not path.is_file():
                if path not in _WARNED:
                    _WARNED.add(path)
                    print(f"note: no profile at {path} (run `conveyor profile`); using built-in CPU numbers",
                          file=sys.stderr)
                return StepCostModel(), "built-in CPU cost model (SmolLM2-135M fp32, 2 cores)"
            spec = str(path)
        cost = StepCostModel.load(spec)
        m = cost.meta
        return cost, f"profile {spec} ({m.get('model')}, {m.get('machine', {}).get('cpu')}, {m.get('date')})"

    def kv_blocks(self) -> tuple[int, int]:
        """(device blocks, host blocks) per replica."""
        c = self.config
        if isinstance(self.cost, RooflineCostModel):
            blocks = c.num_kv_blocks or self.cost.num_kv_blocks()
            host = int(c.swap_space_gib * (1 << 30) // (c.block_size * self.cost.model.kv_bytes_per_token(2, self.tp)))
            return blocks, host
        per_token = self.cost.kv_bytes_per_token or 46080   # the demo model in fp32
        block_bytes = c.block_size * per_token
        return (c.num_kv_blocks or max(1, int(c.kv_cache_gib * (1 << 30) // block_bytes)),
                int(c.swap_space_gib * (1 << 30) // block_bytes))

    def run(self, workload, replicas: int | None = None, trace: bool = False,
            cost: CostModel | None = None) -> SimResult:
        blocks, host = self.kv_blocks()
        c = self.config
        return simulate(workload, c.scheduler, blocks, c.block_size, host, cost or self.cost,
                        replicas=replicas or self.args.replicas, router=self.args.router,
                        prefix_caching=c.enable_prefix_caching, trace=trace, seed=self.args.seed,
                        speculative=self.speculative, speculation=self.speculation,
                        max_loras=c.max_loras if c.enable_lora else 0)

    def describe_speculation(self) -> str:
        if self.speculative is None:
            return "off"
        acc = ", ".join(f"{r:g}" + (f" ({100 * w:.0f}% of requests)" if len(self.speculation.acceptance) > 1 else "")
                        for r, w in self.speculation.acceptance)
        return (f"{self.speculative.method}, up to {self.speculative.num_speculative_tokens} drafts"
                f"{'' if self.speculative.adaptive else ' at every match'}; simulated acceptance {acc} per draft "
                f"token, a guess at {100 * self.speculation.match_rate:.0f}% of decode steps")


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(args.num_requests, args.rate, args.arrival, args.prompt_len, args.output_len,
                        args.max_tokens, args.prefix_groups, args.prefix_len, args.prefix_share,
                        parse_priorities(args.priorities or ""), parse_tenants(args.tenants or ""), args.adapters,
                        args.seed)


def make_workload(args: argparse.Namespace, spec: WorkloadSpec):
    if args.trace:
        return load_trace(args.trace)
    return spec.generate()


# ---- searches -----------------------------------------------------------------------------------

def find_max_rate(run: Callable[[float], SimResult], slo: dict[str, float], start: float = 1.0,
                  rel_tol: float = 0.02) -> tuple[float, SimResult | None]:
    """The highest request rate whose run meets the SLO (bracketing by doubling, then bisection)."""
    good: tuple[float, SimResult] | None = None
    bad = None
    rate = start
    for _ in range(40):
        res = run(rate)
        if res.meets(slo):
            good = (rate, res)
            if bad is not None:
                break
            rate *= 2
        else:
            bad = rate
            if good is not None:
                break
            rate /= 2
            if rate < 1e-4:
                return 0.0, None
    lo, hi = good[0], bad
    best = good
    while hi is not None and (hi - lo) / hi > rel_tol:
        mid = (lo + hi) / 2
        res = run(mid)
        if res.meets(slo):
            lo, best = mid, (mid, res)
        else:
            hi = mid
    return best


def find_replicas(run: Callable[[int], SimResult], slo: dict[str, float], limit: int = 4096) -> tuple[int, SimResult]:
    """The fewest replicas that meet the SLO (doubling, then bisection)."""
    n, results = 1, {}
    while True:
        results[n] = run(n)
        if results[n].meets(slo):
            break
        if n >= limit:
            raise ValueError(f"even {limit} replicas do not meet the SLO")
        n *= 2
    lo, hi = n // 2, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        results[mid] = run(mid)
        if results[mid].meets(slo):
            hi = mid
        else:
            lo = mid
    return hi, results[hi]


# ---- output ---------------------------------------------------------------------------------------

COLUMNS = (("output tok/s", "output_tok_s", 1, "{:.1f}"), ("req/s", "req_s", 1, "{:.2f}"),
           ("TTFT p50", "p50_ttft_s", 1e3, "{:.0f} ms"), ("TTFT p99", "p99_ttft_s", 1e3, "{:.0f} ms"),
           ("TPOT p50", "p50_tpot_s", 1e3, "{:.1f} ms"), ("TPOT p99", "p99_tpot_s", 1e3, "{:.1f} ms"),
           ("E2E p50", "p50_e2e_s", 1, "{:.2f} s"), ("preempt", "num_preemptions", 1, "{:.0f}"),
           ("prefix hit", "prefix_cache_hit_rate", 100, "{:.0f}%"),
           ("KV mean/peak", None, 1, ""), ("goodput", "goodput_req_s", 1, "{:.2f}"))


def table(rows: list[tuple[str, dict]]) -> str:
    head = ["run"] + [c[0] for c in COLUMNS if c[0] != "goodput" or "goodput_req_s" in rows[0][1]]
    lines = [head]
    for label, s in rows:
        cells = [label]
        for name, key, scale, fmt in COLUMNS:
            if name == "goodput" and "goodput_req_s" not in s:
                continue
            if key is None:
                cells.append(f"{100 * s['mean_kv_usage']:.0f}% / {100 * s['peak_kv_usage']:.0f}%"
                             if "mean_kv_usage" in s else "-")
            else:
                v = s.get(key, math.nan)
                cells.append("-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v * scale))
        lines.append(cells)
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in lines)


def spec_line(label: str, s: dict) -> str | None:
    """A run's speculative-decoding counters in a line (None: speculation off)."""
    if "spec_drafts" not in s:
        return None
    if not s["spec_drafts"]:
        return f"{label}: speculation proposed nothing"
    return (f"{label}: speculation {s['spec_drafts']} verifications of {s['spec_draft_tokens']} draft tokens, "
            f"{s['spec_accepted_tokens']} accepted (acceptance rate {100 * s['spec_acceptance_rate']:.0f}%, "
            f"first position {100 * s['spec_first_position_rate']:.0f}%), {s['spec_tokens_per_draft']:.2f} tokens "
            f"per verification, {s['spec_tokens_per_step']:.2f} tokens per request step")


def split_values(values: str) -> list[str]:
    """A sweep's values: split on the commas outside braces and brackets (a JSON object is one value)."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(values):
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(values[start:i])
            start = i + 1
    out.append(values[start:])
    return out


def _with_knob(args: argparse.Namespace, name: str, value: str) -> argparse.Namespace:
    a = argparse.Namespace(**vars(args))
    if name == "speculative_config":   # a JSON object, or none / off
        setattr(a, name, None if value.strip().lower() in ("none", "off", "") else value)
        return a
    if name == "spec_acceptance":   # P, or P:WEIGHT (parsed by SimSpeculation)
        setattr(a, name, value)
        return a
    current = getattr(a, name)
    kind = type(current) if current is not None else (float if "." in value else int)
    if kind is bool:
        setattr(a, name, value.lower() in ("1", "true", "yes", "on"))
    else:
        setattr(a, name, kind(value) if value not in ("inf", "none") or kind is float else None)
    return a


SWEEPABLE_EXTRA = ("rate", "num_requests", "replicas", "tensor_parallel", "arrival", "prompt_len", "output_len",
                   "spec_acceptance", "spec_match_rate")


def cmd_validate(args: argparse.Namespace) -> int:
    """--validate TRACE [TRACE ...] [--calibrate OUT]: the cost model against real engine step traces."""
    # lazy: keeps numpy out of the torch-free units
    from conveyor.sim.validate import calibrate, format_errors, validate

    setup = Setup(args)
    if not isinstance(setup.cost, StepCostModel):
        raise ValueError("--validate checks a profile (a step-cost model), not a roofline model")
    traces = [StepTracer.load(path) for path in args.validate]
    print(f"cost model: {setup.describe}")
    for path, t in zip(args.validate, traces):
        print(f"trace: {path} ({len(t.records)} steps, {t.meta.get('source', '?')}, {t.meta.get('model', '?')})")
    if args.calibrate:
        corrected, report = calibrate(traces, setup.cost)
        print(format_errors(report["before"], f"held-out steps ({report['held_out_steps']}; fitted on "
                                              f"{report['fit_steps']}), the profile as it is:"))
        print(format_errors(report["after"], "the same steps, corrected:"))
        print(f"between steps: {report['between_steps_ms']:.2f} ms (the simulator waits that long after each step)")
        corrected.save(args.calibrate)
        print(f"wrote {args.calibrate} (use it with --cost-model {args.calibrate})")
    else:
        report = validate(traces, setup.cost)
        print(format_errors(report, "every step of the trace:"))
    if args.out:
        paths = args.validate if len(args.validate) > 1 else args.validate[0]
        Path(args.out).write_text(json.dumps({"cost_model": setup.describe, "trace": paths, **report},
                                             indent=1, default=str))
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    if args.validate:
        return cmd_validate(args)
    if args.calibrate:
        raise ValueError("--calibrate OUT goes with --validate TRACE")
    if args.sensitivity and (args.find_max_rate or args.find_replicas):
        raise ValueError("--sensitivity goes with a run or a --sweep, not with --find-max-rate / --find-replicas")
    slo = parse_slo(args.slo) if args.slo else None
    sweep_name, sweep_values = None, [None]
    if args.sweep:
        sweep_name, _, values = args.sweep.partition("=")
        sweep_name = sweep_name.replace("-", "_")
        engine_names, sched_names = option_names()
        if sweep_name not in engine_names + sched_names + list(SWEEPABLE_EXTRA) or not values:
            raise ValueError(f"--sweep NAME=V1,V2,...: NAME is an engine option or one of {', '.join(SWEEPABLE_EXTRA)}")
        sweep_values = split_values(values)
    if (args.spec_acceptance is not None or args.spec_match_rate is not None) and not args.speculative_config \
            and sweep_name != "speculative_config":
        raise ValueError("--spec-acceptance and --spec-match-rate describe the workload's drafts: they go with "
                         "--speculative-config (or a --sweep of it)")
    rows, report = [], {"runs": []}
    for value in sweep_values:
        a = _with_knob(args, sweep_name, value) if sweep_name else args
        setup = Setup(a)
        spec = workload_spec(a)
        label = f"{sweep_name}={value}" if sweep_name else "run"
        t0 = time.perf_counter()
        if args.find_max_rate:
            if not slo:
                raise ValueError("--find-max-rate needs --slo")
            rate, res = find_max_rate(lambda r: setup.run(make_workload(a, replace(spec, rate=r))), slo,
                                      start=a.rate if math.isfinite(a.rate) else 1.0)
            if res is None:
                print(f"{label}: no rate meets the SLO", file=sys.stderr)
                continue
            label += f" max rate {rate:.3g}/s"
            entry = {"max_rate": rate}
        elif args.find_replicas:
            if not slo or not math.isfinite(a.rate):
                raise ValueError("--find-replicas needs --slo and a finite --rate")
            n, res = find_replicas(lambda k: setup.run(make_workload(a, spec), replicas=k), slo)
            gpus = n * setup.tp if a.gpu else None
            label += f" {n} replica(s)" + (f" = {gpus} GPU(s)" if gpus else "")
            entry = {"replicas": n, "gpus": gpus}
        else:
            res = setup.run(make_workload(a, spec), trace=True)
            entry = {}
            if args.sensitivity:
                if not isinstance(setup.cost, StepCostModel):
                    raise ValueError("--sensitivity prices steps with a profile's cost model, not a roofline one")
                entry["elasticity"] = elasticity(
                    lambda c: {m: setup.run(make_workload(a, spec), cost=c).metric(m) for m in SENSITIVITY_METRICS},
                    setup.cost, {m: res.metric(m) for m in SENSITIVITY_METRICS})
        summary = res.summary(slo)
        rows.append((label, summary))
        report["runs"].append({"label": label, sweep_name or "run": value, **entry, "summary": summary,
                               "wall_s": time.perf_counter() - t0})
        if args.step_trace and res.traces:
            res.traces[0].meta.update(source="simulator", cost_model=setup.describe)
            res.traces[0].save(args.step_trace)
            res.traces[0].save_chrome(Path(args.step_trace).with_suffix(".chrome.json"))
    if not rows:
        return 1
    blocks, host = setup.kv_blocks()
    print(f"cost model: {setup.describe}; KV cache: {blocks} blocks of {setup.config.block_size} tokens "
          f"per replica" + ("" if sweep_name else f", {args.replicas} replica(s)"))
    if any("spec_drafts" in s for _, s in rows):
        print(f"speculative decoding: {setup.describe_speculation() if setup.speculative else 'see the runs'}")
    print(table(rows))
    for label, s in rows:
        line = spec_line(label, s)
        if line:
            print(line)
    for run in report["runs"]:
        if "elasticity" in run:
            print(f"{run['label']}: % change per 1% of every step cost (costs {100 * SENSITIVITY_STEP:.0f}% up and "
                  "down): " + ", ".join(f"{m} {e:+.1f}" for m, e in run["elasticity"].items()))
    report.update(cost_model=setup.describe, kv_blocks=blocks, slo=slo, argv=sys.argv[1:],
                  speculation={"acceptance": setup.speculation.acceptance, "match_rate": setup.speculation.match_rate})
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("simulate", help="simulate the scheduler on a cost model: throughput, latency, "
                                               "capacity", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    c = p.add_argument_group("cost model")
    c.add_argument("--cost-model", default="auto",
                   help="a `conveyor profile` JSON ('auto': the profile saved for --model, else built-in numbers)")
    c.add_argument("--gpu", choices=sorted(GPUS), help="a roofline model of this GPU instead of a profile")
    c.add_argument("--model", help=f"model name (for its saved profile) or, with --gpu, a preset "
                                   f"({', '.join(MODEL_PRESETS)}) or an HF config.json")
    c.add_argument("--tensor-parallel", type=int, default=1, help="with --gpu: GPUs per replica")
    c.add_argument("--efficiency", help="with --gpu: compute=0.5,bandwidth=0.8,overhead_ms=0.5")
    c.add_argument("--validate", metavar="TRACE", nargs="+",
                   help="instead of simulating: price every step of a real engine's step trace (conveyor serve "
                        "--step-trace; several: pooled, e.g. a server's last few runs) with the cost model and "
                        "report the error per step shape")
    c.add_argument("--calibrate", metavar="OUT",
                   help="with --validate: fit a correction on half of the trace's steps (reported on the other "
                        "half) and write the corrected profile to OUT")
    w = p.add_argument_group("workload")
    w.add_argument("--trace", help="a JSONL request trace (arrival, prompt_len, output_len[, max_tokens, priority, "
                                   "prefix_group, prefix_len]) instead of the distributions below")
    w.add_argument("--num-requests", type=int, default=500)
    w.add_argument("--rate", type=float, default=math.inf, help="requests per second (inf: all at once)")
    w.add_argument("--arrival", default="poisson", help="poisson, gamma:CV or constant")
    w.add_argument("--prompt-len", default="32:256", help="LO:HI, N, lognormal:MEDIAN:SIGMA[:MAX] or exp:MEAN[:MAX]")
    w.add_argument("--output-len", default="16:256", help="the true output lengths (same forms)")
    w.add_argument("--max-tokens", help="the clients' max_tokens (same forms; default: each request's output length)")
    w.add_argument("--prefix-groups", type=int, default=0, help="groups of requests that share a prompt prefix")
    w.add_argument("--prefix-len", type=int, default=0, help="tokens of the shared prefix")
    w.add_argument("--prefix-share", type=float, default=1.0, help="fraction of requests in a group")
    w.add_argument("--priorities", help="priority:weight,... e.g. 0:0.9,1:0.1")
    w.add_argument("--tenants", help="tenant:share,... of the requests, e.g. heavy:10,light:1 (scheduled by "
                                     "--tenant-fairness; the summary reports each tenant)")
    w.add_argument("--adapters", type=int, default=0, help="spread the requests over N LoRA adapters (with "
                                                           "--enable-lora: at most --max-loras run at once)")
    w.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("speculative decoding (with --speculative-config, the engine's option)")
    s.add_argument("--spec-acceptance", type=str, default=None, metavar="P",
                   help="the chance that each draft token is the model's own, independently, up to the first "
                        f"refused one (default {DEFAULT_ACCEPTANCE}); P1:W1,P2:W2,...: a mix of requests (e.g. "
                        "0.9:0.3,0.2:0.7: 30%% of requests at 0.9). From a real run: its accepted drafts at the "
                        "first position / its verifications")
    s.add_argument("--spec-match-rate", type=float, default=None, metavar="Q",
                   help="the chance that the proposer has a guess at a decode step "
                        f"(default {DEFAULT_MATCH_RATE}: always)")
    r = p.add_argument_group("runs")
    r.add_argument("--replicas", type=int, default=1, help="engine replicas behind a router")
    r.add_argument("--router", default="least-load", choices=(*POLICIES, *ALIASES),
                   help="the data-parallel server's routing policy (conveyor/routing.py); prefix routing "
                        "pays with prefix caching on (the default) and shared prefixes (--prefix-groups); "
                        "least-loaded: an alias of least-load")
    r.add_argument("--slo", help="e.g. ttft_p99=2s,tpot_p50=100ms (goodput counts requests within the bounds)")
    r.add_argument("--sweep", help="NAME=V1,V2,...: one run per value of an engine option, or of rate, "
                                   "num_requests, replicas, tensor_parallel, arrival, prompt_len, output_len, "
                                   "spec_acceptance, spec_match_rate (speculative_config: none or a JSON object)")
    r.add_argument("--find-max-rate", action="store_true", help="the highest request rate that meets --slo")
    r.add_argument("--find-replicas", action="store_true", help="the fewest replicas that meet --slo at --rate")
    r.add_argument("--sensitivity", action="store_true",
                   help="also run with every step cost 5%% up and down: each metric's %% change per 1%% of "
                        "step cost (near saturation several: the plan is only as good as the cost model's error "
                        "times that)")
    r.add_argument("--step-trace", help="write the (last) run's step trace here (JSON, + .chrome.json)")
    r.add_argument("--out", help="write the results as JSON")
    add_engine_args(p, skip=("cost_model", "step_trace", "device", "torch_threads", "max_consecutive_step_failures",
                             "seed"))
    p.set_defaults(func=cmd_simulate)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="conveyor")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["simulate", *(argv or [])])
    return args.func(args)


__all__ = ["add_parser", "cmd_simulate", "find_max_rate", "find_replicas", "parse_slo", "table"]
