"""`conveyor` command line: generate (offline batch), serve (OpenAI-compatible HTTP), profile, simulate, plot, bench."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from conveyor.bench.serve import add_parser as add_serve_bench_parser
from conveyor.config import add_engine_args, config_from_args
from conveyor.paths import profile_path
from conveyor.plot import add_parser as add_plot_parser
from conveyor.sampling.params import SamplingParams
from conveyor.server.batch import add_run_batch_parser
from conveyor.server.cli import add_serve_parser
from conveyor.sim.cli import add_parser as add_simulate_parser


def read_prompts(path: Path) -> list[str | dict]:
    """One prompt per line, or JSONL objects with a "prompt" (or "prompt_token_ids") field."""
    prompts: list[str | dict] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            obj = json.loads(line)
            prompts.append(obj if "prompt_token_ids" in obj else obj["prompt"])
        else:
            prompts.append(line)
    return prompts


def cmd_generate(args: argparse.Namespace) -> int:
    from conveyor.engine.llm import LLM   # lazy: keeps torch out of the CLI's start-up

    prompts: list = list(args.prompt)
    if args.file:
        prompts += read_prompts(Path(args.file))
    if not prompts:
        print("error: give a prompt or --file", file=sys.stderr)
        return 2
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sampling_seed, n=args.n)
    llm = LLM(config=config_from_args(args, model=args.model))
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params) if args.chat \
        else llm.generate(prompts, params)
    for out in outputs:
        for c in out.outputs:
            if args.json:
                print(json.dumps({"prompt": out.prompt, "text": c.text, "finish_reason": c.finish_reason,
                                  "token_ids": c.token_ids, "error": out.error}))
            elif out.error:
                print(f"error: {out.error}", file=sys.stderr)
            else:
                print(c.text if args.chat else f"{out.prompt}{c.text}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    # lazy: keeps torch out of the CLI's start-up
    from conveyor.engine.engine import Engine
    from conveyor.profile import profile

    if args.rescale and not args.recheck:
        raise ValueError("--rescale goes with --recheck")
    # The calibration step (meant for an idle machine) also measures the kernel-path probes afresh
    # and remembers them for every later start (conveyor/model/probe_cache.py).
    os.environ.setdefault("CONVEYOR_PROBES", "fresh")
    engine = Engine(config_from_args(args, model=args.model, cost_model="none"))
    # With --torch-threads N the profile is N threads' own (an engine running N threads looks for it first).
    out = Path(args.out) if args.out else profile_path(engine.model_name, engine.dtype, args.torch_threads)
    if args.recheck:
        return _recheck(engine, out, args.rescale and args.rescale_by)
    model = profile(engine, quick=args.quick, repeats=args.repeats, passes=args.passes)
    model.save(out)   # before the sustained run: if that fails, the profile is kept
    fit = model.meta["fit"]
    print(f"{fit['samples']} step shapes fitted within {100 * fit['mean_abs_rel_error']:.1f}% on average "
          f"(worst {100 * fit['max_abs_rel_error']:.1f}%); decode at batch 1 {1e3 * model.token_cost(1):.1f} ms, "
          f"swap {1e3 * model.swap_block:.2f} ms per block")
    if args.sustained:
        from conveyor.sim.validate import sustained_calibration   # lazy: keeps numpy out of the CLI's start-up

        n = args.sustained_requests
        model, report = sustained_calibration(engine, model, requests=n)
        before, after = report["before"]["all"], report["after"]["all"]
        print(f"sustained run ({n} requests, {report['fit_steps'] + report['held_out_steps']} busy steps): "
              f"held-out steps {100 * before['error']:+.1f}% (mean |err| {100 * before['mean_abs_error']:.1f}%) "
              f"-> corrected {100 * after['error']:+.1f}% ({100 * after['mean_abs_error']:.1f}%), "
              f"{report['between_steps_ms']:.2f} ms between steps")
        model.save(out)
    print(f"saved {out}")
    return 0


def _recheck(engine, path: Path, rescale: str | bool) -> int:
    """`conveyor profile --recheck [--rescale [--rescale-by size|median]]`: the saved profile's probe steps
    timed again; `rescale` is False or how to scale."""
    from conveyor.profile import recheck_profile   # lazy: keeps torch out of the CLI's start-up

    check = recheck_profile(engine, path, bool(rescale), by_size=rescale == "size")
    for name, ratio in check["ratios"].items():
        print(f"{name:>16}: {1e3 * check['then_s'][name]:8.2f} ms as the profile prices it, "
              f"{1e3 * check['now_s'][name]:8.2f} ms now ({ratio:.2f}x)")
    print(f"this machine runs the profile's steps {check['factor']:.2f}x as long as the profile prices them "
          f"(profiled {check['profiled']})")
    if rescale == "size":
        sizes = ", ".join(f"{n} tokens {f:.2f}x" for n, f in sorted(check["by_tokens"].items()))
        print(f"rescaled by size ({sizes}; between them interpolated) and saved {path}")
    elif rescale:
        print(f"rescaled by {check['factor']:.2f} and saved {path}")
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def add_profile_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure the engine on this machine and fit the simulator's cost model",
                       description="Sweep prefill chunks, decode batches, mixed steps and swap copies through the "
                                   "real engine; fit and save the cost model that `conveyor simulate` and the auto "
                                   "preemption mode use (a minute or two).")
    p.add_argument("model", nargs="?", default=None, help="HF model directory or .gguf file (default: the demo model)")
    p.add_argument("--out", help="where to save the JSON (default: the profile cache, found by simulate and the engine)")
    p.add_argument("--quick", action="store_true", help="fewer shapes (seconds instead of a minute)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs per shape at least (short steps run for 0.1 s; the median counts)")
    p.add_argument("--passes", type=_positive_int, default=None,
                   help="sweeps over all shapes, each shape's median over them counts (default 3, 1 with --quick)")
    p.add_argument("--sustained", action="store_true",
                   help="then a sustained run of mixed traffic (at 70%% of the predicted saturation) and a "
                        "correction fitted on its step trace (see conveyor simulate --validate)")
    p.add_argument("--sustained-requests", type=_positive_int, default=60, metavar="N",
                   help="requests in the sustained run (default 60)")
    p.add_argument("--recheck", action="store_true",
                   help="instead of profiling: time the saved profile's probe steps again (seconds) and say how much "
                        "slower or faster this machine runs them now than the profile prices them")
    p.add_argument("--rescale", action="store_true", help="with --recheck: save the profile scaled by what it found")
    p.add_argument("--rescale-by", choices=("size", "median"), default="size",
                   help="with --rescale: each probe's factor over the step-cost curve by step size (default: small "
                        "memory-bound steps and large ones drift apart), or their median for every step")
    add_engine_args(p, skip=("cost_model", "step_trace"))
    p.set_defaults(func=cmd_profile)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text offline for one or more prompts")
    g.add_argument("prompt", nargs="*", help="prompt text(s)")
    g.add_argument("--model", default=None, help="HF model directory or .gguf file (default: the demo model)")
    g.add_argument("--file", help="read prompts from a file: one per line, or JSONL with a 'prompt' field")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    g.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate per prompt")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("-n", type=int, default=1, help="completions per prompt")
    g.add_argument("--json", action="store_true", help="print one JSON object per completion")
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)
    add_serve_parser(sub)
    add_run_batch_parser(sub)
    add_profile_parser(sub)
    add_simulate_parser(sub)
    add_plot_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="benchmark", required=True)
    add_serve_bench_parser(bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "ray", False):   # conveyor serve --ray: the app on Ray Serve (conveyor/ray/serve.py)
        from conveyor.ray.serve import serve_from_cli   # lazy: keeps torch out of the CLI's start-up

        return serve_from_cli(args)
    try:
        return args.func(args) or 0
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
