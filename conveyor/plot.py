"""`conveyor plot TRACE [TRACE ...]`: timelines of step traces, side by side (matplotlib, PNG).

One column per trace (e.g. a real run and its simulation), four rows sharing the time axis:
batch composition (prefill and decode tokens per step), KV cache usage, queue lengths
(running, waiting, swapped) and preemptions (cumulative).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from conveyor.core.trace import StepTracer


def plot_traces(traces: list[StepTracer], labels: list[str], out: str | Path, title: str | None = None) -> Path:
    import matplotlib   # lazy: optional dependency (matplotlib)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt   # lazy: optional dependency (matplotlib)

    fig, axes = plt.subplots(4, len(traces), figsize=(6.5 * len(traces), 9), sharex="col", sharey="row",
                             squeeze=False)
    for col, (trace, label) in enumerate(zip(traces, labels)):
        recs = trace.records
        t0 = recs[0].t if recs else 0.0
        t = [r.t - t0 for r in recs]
        ax = axes[0][col]
        ax.stackplot(t, [r.decode_tokens for r in recs], [r.prefill_tokens for r in recs],
                     labels=["decode tokens", "prefill tokens"], step="post", alpha=0.8)
        ax.set_title(label)
        ax = axes[1][col]
        ax.plot(t, [100 * r.kv_usage for r in recs], drawstyle="steps-post", color="tab:purple")
        ax.set_ylim(0, 105)
        ax = axes[2][col]
        for name, color in (("running", "tab:green"), ("waiting", "tab:orange"), ("swapped", "tab:red")):
            ax.plot(t, [getattr(r, name) for r in recs], drawstyle="steps-post", label=name, color=color)
        ax = axes[3][col]
        total, cum = 0, []
        for r in recs:
            total += r.preempted
            cum.append(total)
        ax.plot(t, cum, drawstyle="steps-post", color="tab:red")
        ax.set_xlabel("time (s)")
    for row, name in enumerate(("tokens per step", "KV usage (%)", "requests", "preemptions (cumulative)")):
        axes[row][0].set_ylabel(name)
    axes[0][0].legend(loc="upper right", fontsize=8)
    axes[2][0].legend(loc="upper right", fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plot", help="draw step traces (from the engine or the simulator) as timelines",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", help="step trace JSON files (--step-trace of serve, generate or simulate)")
    p.add_argument("--labels", help="comma-separated column titles (default: the file names)")
    p.add_argument("--title")
    p.add_argument("-o", "--out", default="trace.png", help="PNG to write")
    p.set_defaults(func=cmd_plot)


def cmd_plot(args: argparse.Namespace) -> int:
    traces = [StepTracer.load(p) for p in args.traces]
    labels = args.labels.split(",") if args.labels else [Path(p).stem for p in args.traces]
    if len(labels) != len(traces):
        raise ValueError(f"{len(labels)} labels for {len(traces)} traces")
    print(plot_traces(traces, labels, args.out, args.title))
    return 0
