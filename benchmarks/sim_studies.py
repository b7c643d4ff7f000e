"""The seed's trade-offs, studied with the simulator (the real scheduler on a cost model).

1. Swap vs recompute: the cost of giving a victim's KV back and getting it again, by its
   context length, on this CPU (the `conveyor profile` model) and on an H200 (the roofline
   model, PCIe 5); then a preempting workload run with each mode and with `auto`.
2. The admission knob: predictive admission's quantile q and reservation buffer on a
   long-tailed workload (clients ask max_tokens 1024, most answers are short), against the
   optimistic and conservative policies: preemptions vs queueing.
3. Chunk size vs latency: the per-request prefill cap (long_prefill_token_threshold) under a
   mix of long prompts and short chats: TTFT against TPOT.

Writes benchmarks/results/sim_studies.json, docs/img/sim_swap_recompute.png,
docs/img/sim_admission.png, docs/img/sim_chunk.png and a line in docs/benchmarks.md.

    python benchmarks/sim_studies.py
"""

from __future__ import annotations

from dataclasses import asdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from common import ROOT, save  # noqa: E402
from conveyor.paths import profile_path  # noqa: E402
from conveyor.scheduler.config import SchedulerConfig  # noqa: E402
from conveyor.sim.cost import StepCostModel  # noqa: E402
from conveyor.sim.roofline import GPUS, MODEL_PRESETS, RooflineCostModel  # noqa: E402
from conveyor.sim.simulator import simulate  # noqa: E402
from conveyor.sim.workload import WorkloadSpec  # noqa: E402

IMG = ROOT / "docs" / "img"
BLOCK = 16


def cpu_model() -> StepCostModel:
    path = profile_path("SmolLM2-135M-Instruct", "float32")
    return StepCostModel.load(path) if path.is_file() else StepCostModel()


def preemption_costs(cost, contexts: list[int]) -> dict:
    """What the auto preemption mode weighs for a victim of each context length: copying its
    blocks out and back in, against recomputing its tokens (as prefill work in a full step)."""
    swap = [2 * -(-c // BLOCK) * cost.swap_time(1) for c in contexts]
    recompute = [c * cost.recompute_time_per_token(c) for c in contexts]
    return {"context": contexts, "swap_s": swap, "recompute_s": recompute}


def study_swap_vs_recompute() -> dict:
    contexts = [16, 64, 256, 1024, 4096]
    cpu = cpu_model()
    h200 = RooflineCostModel(GPUS["h200"], MODEL_PRESETS["llama-3.1-8b"])
    out = {"cpu_smollm2": preemption_costs(cpu, contexts), "h200_llama8b": preemption_costs(h200, contexts)}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (name, d) in zip(axes, out.items()):
        ax.loglog(d["context"], d["swap_s"], "o-", label="swap out + in")
        ax.loglog(d["context"], d["recompute_s"], "s-", label="recompute (prefill work)")
        ax.set_title({"cpu_smollm2": "this CPU, SmolLM2-135M fp32 (profiled)",
                      "h200_llama8b": "H200, Llama-3.1-8B bf16 (roofline, PCIe 5)"}[name])
        ax.set_xlabel("victim's context (tokens)")
        ax.set_ylabel("seconds")
        ax.legend()
    fig.tight_layout()
    fig.savefig(IMG / "sim_swap_recompute.png", dpi=110)
    plt.close(fig)
    # The same preempting workload under each mode.
    runs = {}
    for machine, cost, blocks, spec, budget in (
            ("cpu", cpu, 150, WorkloadSpec(num_requests=600, rate=0.9, prompt_len="16:512",
                                           output_len="lognormal:60:1:1024", seed=11), 1024),
            ("h200", h200, 2000, WorkloadSpec(num_requests=600, rate=8, prompt_len="512:2048",
                                              output_len="lognormal:200:1:2048", seed=7), 4096)):
        for mode in ("recompute", "swap", "auto"):
            cfg = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=budget, preemption_mode=mode,
                                  admission_policy="optimistic")
            res = simulate(spec.generate(), cfg, num_blocks=blocks, num_host_blocks=4 * blocks, cost=cost)
            runs[f"{machine}/{mode}"] = res.summary()
            s = runs[f"{machine}/{mode}"]
            print(f"{machine} {mode:9s} tok/s {s['output_tok_s']:.1f} TTFT p50 {s['p50_ttft_s']:.2f}s "
                  f"E2E p50 {s['p50_e2e_s']:.2f}s preemptions {s['num_preemptions']} swaps {s['num_swaps_out']}",
                  flush=True)
    out["runs"] = runs
    return out


def study_admission() -> dict:
    cost = cpu_model()
    spec = WorkloadSpec(num_requests=600, rate=0.9, prompt_len="16:512", output_len="lognormal:60:1:1024",
                        max_tokens="1024", seed=11)
    rows = []
    configs = [("optimistic", {}), ("conservative", {})]
    configs += [("predictive", {"admission_quantile": q, "reservation_buffer": b})
                for q in (0.3, 0.5, 0.8, 0.9, 0.99) for b in (0.0, 0.05, 0.1)]
    for policy, knobs in configs:
        cfg = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024, admission_policy=policy, **knobs)
        s = simulate(spec.generate(), cfg, num_blocks=150, cost=cost).summary()
        rows.append({"policy": policy, **knobs, **s})
        print(policy, knobs, f"preemptions {s['num_preemptions']} TTFT p50 {s['p50_ttft_s']:.2f}s "
                             f"p99 {s['p99_ttft_s']:.1f}s E2E p50 {s['p50_e2e_s']:.1f}s tok/s {s['output_tok_s']:.1f}",
              flush=True)
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for r in rows:
        label = r["policy"] if r["policy"] != "predictive" else f"q={r['admission_quantile']}, b={r['reservation_buffer']}"
        marker = {"optimistic": "v", "conservative": "^"}.get(r["policy"], "o")
        ax.scatter(r["num_preemptions"], r["p50_ttft_s"], marker=marker, s=40)
        if r["policy"] != "predictive" or r["reservation_buffer"] == 0.05:
            ax.annotate(label, (r["num_preemptions"], r["p50_ttft_s"]), fontsize=7, xytext=(4, 2),
                        textcoords="offset points")
    ax.set_xlabel("preemptions (600 requests)")
    ax.set_ylabel("TTFT p50 (s)")
    ax.set_title("admission: preemptions vs queueing (this CPU's profile)")
    fig.tight_layout()
    fig.savefig(IMG / "sim_admission.png", dpi=110)
    plt.close(fig)
    return {"workload": asdict(spec), "rows": rows}


def study_chunk() -> dict:
    cost = cpu_model()
    # Half long documents, half short chats, near the machine's capacity.
    long = WorkloadSpec(num_requests=60, rate=0.25, prompt_len="1024:3000", output_len="32:64", seed=21).generate()
    chat = WorkloadSpec(num_requests=150, rate=0.7, prompt_len="16:64", output_len="32:128", seed=22).generate()
    wl = sorted(long + chat, key=lambda r: r.arrival)
    rows = []
    for chunk in (32, 64, 128, 256, 512, 1024, 2048):
        cfg = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=max(2048, chunk),
                              long_prefill_token_threshold=chunk)
        res = simulate(wl, cfg, num_blocks=4000, cost=cost)
        s = res.summary()
        chats = [r for r, w in zip(res.records, wl) if w.prompt_len <= 64]
        longs = [r for r, w in zip(res.records, wl) if w.prompt_len > 64]
        row = {"chunk": chunk, **s,
               "chat_ttft_p50_s": _p([r.ttft for r in chats], 50), "chat_ttft_p99_s": _p([r.ttft for r in chats], 99),
               "long_ttft_p50_s": _p([r.ttft for r in longs], 50), "tpot_p99_s": s["p99_tpot_s"]}
        rows.append(row)
        print(f"chunk {chunk:5d}: chat TTFT p50 {row['chat_ttft_p50_s']:.2f}s p99 {row['chat_ttft_p99_s']:.2f}s, "
              f"long TTFT p50 {row['long_ttft_p50_s']:.2f}s, TPOT p50 {1e3 * s['p50_tpot_s']:.0f} ms "
              f"p99 {1e3 * s['p99_tpot_s']:.0f} ms, tok/s {s['output_tok_s']:.1f}", flush=True)
    fig, ax1 = plt.subplots(figsize=(6.5, 4.5))
    xs = [r["chunk"] for r in rows]
    ax1.semilogx(xs, [r["chat_ttft_p99_s"] for r in rows], "o-", label="chat TTFT p99", base=2)
    ax1.semilogx(xs, [r["long_ttft_p50_s"] for r in rows], "s-", label="long-prompt TTFT p50", base=2)
    ax1.set_xlabel("prefill chunk cap (tokens per request per step)")
    ax1.set_ylabel("seconds")
    ax2 = ax1.twinx()
    ax2.semilogx(xs, [1e3 * r["p99_tpot_s"] for r in rows], "^--", color="tab:red", label="TPOT p99 (ms)", base=2)
    ax2.set_ylabel("TPOT p99 (ms)")
    lines = ax1.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax1.legend(lines, [h.get_label() for h in lines], fontsize=8)
    ax1.set_title("chunked prefill: chunk cap vs latency (this CPU's profile)")
    fig.tight_layout()
    fig.savefig(IMG / "sim_chunk.png", dpi=110)
    plt.close(fig)
    return {"rows": rows}


def _p(xs: list, q: float) -> float:
    from conveyor.sim.simulator import percentile

    return percentile([x for x in xs if x is not None], q)


def main() -> None:
    swap = study_swap_vs_recompute()
    admission = study_admission()
    chunk = study_chunk()
    cpu = swap["cpu_smollm2"]
    ratio = min(r / s for s, r in zip(cpu["swap_s"], cpu["recompute_s"]))
    gpu = swap["h200_llama8b"]
    gpu_ratio = min(r / s for s, r in zip(gpu["swap_s"], gpu["recompute_s"]))
    runs = swap["runs"]
    line = (f"swap vs recompute: swapping a victim costs at least {ratio:.0f}x less than recomputing it on this CPU "
            f"and {gpu_ratio:.1f}x less on an H200 (roofline); auto vs recompute "
            f"E2E p50 {runs['cpu/auto']['p50_e2e_s']:.1f}s vs {runs['cpu/recompute']['p50_e2e_s']:.1f}s (CPU), "
            f"{runs['h200/auto']['p50_e2e_s']:.1f}s vs {runs['h200/recompute']['p50_e2e_s']:.1f}s (H200 roofline); "
            f"admission and chunk-size sweeps in the JSON")
    save("sim_studies", {"swap_vs_recompute": swap, "admission": admission, "chunk": chunk}, line)


if __name__ == "__main__":
    main()
