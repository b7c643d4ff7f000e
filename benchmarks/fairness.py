"""Fairness between tenants: a flooding tenant (10x the load of the other, and more than the engine can
serve) and a light one, scheduled first come first served and by the Virtual Token Counter, in the
simulator and on the real engine (the demo model), on the same workload.

For each policy: the light tenant's TTFT (mean, p99) against VTC's bound for it (docs/scheduling.md,
"Fairness between tenants"), each tenant's share of the tokens served, and the total throughput
(VTC against FCFS: the price of fairness).

    python benchmarks/fairness.py [--engine-seconds 60]

Writes benchmarks/results/fairness.json and a line in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import random
import statistics

from common import machine, save
from conveyor.engine.engine import Engine
from conveyor.config import EngineConfig
from conveyor.paths import profile_path
from conveyor.scheduler.config import SchedulerConfig
from conveyor.sim.cost import StepCostModel
from conveyor.sim.harness import run_on_engine
from conveyor.sim.simulator import SimResult, engine_knobs, saturation_rate, simulate
from conveyor.sim.workload import SimRequest

PROMPT, OUTPUT = (32, 256), (16, 256)


def workload(heavy_rate: float, seconds: float, seed: int = 0) -> list[SimRequest]:
    """Poisson arrivals: the heavy tenant at `heavy_rate` req/s, the light one at a tenth of it."""
    rng, out = random.Random(seed), []
    for tenant, rate in (("heavy", heavy_rate), ("light", heavy_rate / 10)):
        t = 0.0
        while (t := t + rng.expovariate(rate)) < seconds:
            out.append(SimRequest(t, rng.randint(*PROMPT), rng.randint(*OUTPUT), tenant=tenant))
    return sorted(out, key=lambda r: r.arrival)


def light_bound(config: SchedulerConfig, cost: StepCostModel) -> float:
    """VTC's bound on a light tenant's TTFT here: its request is the next one admitted (at most one heavy
    request tied with it goes first), so it waits for the next free slot -- at worst for a running
    request to finish its longest output at a full batch's step time -- then one more request's prompt,
    then its own, as prefill chunks beside the running decodes."""
    full = cost.token_cost(config.max_num_seqs) + cost.sampled * config.max_num_seqs
    chunk = config.prefill_chunk_cap
    prefill = cost.token_cost(config.max_num_seqs + chunk) + cost.sampled * config.max_num_seqs
    chunks = 2 * -(-PROMPT[1] // chunk)
    return OUTPUT[1] * full + chunks * prefill


def summary(result: SimResult) -> dict:
    s = result.summary()
    return {"output_tok_s": s["output_tok_s"], "tenants": s["tenants"]}


def run(args) -> dict:
    cost = StepCostModel.load(profile_path("SmolLM2-135M-Instruct", "float32")) \
        if profile_path("SmolLM2-135M-Instruct", "float32").is_file() else StepCostModel()
    config = {p: SchedulerConfig(tenant_fairness=p, max_num_seqs=32) for p in ("fcfs", "vtc")}
    knobs = dict(num_blocks=1024, block_size=16)
    capacity = saturation_rate(workload(50.0, 20.0), cost, config=config["fcfs"], **knobs)
    sim_load = workload(1.5 * capacity, args.sim_seconds)
    out = {"machine": machine(), "capacity_req_s": capacity, "heavy_rate": 1.5 * capacity,
           "light_rate": 0.15 * capacity, "simulator": {}, "engine": {}}
    for policy, cfg in config.items():
        r = simulate(sim_load, cfg, cost=cost, **knobs)
        out["simulator"][policy] = summary(r)
    out["simulator"]["light_ttft_bound_s"] = light_bound(config["vtc"], cost)

    # the real engine, on a shorter run of the same shape; its own capacity measured the same way (a burst)
    engines = {p: Engine(EngineConfig.from_options(dtype="float32", tenant_fairness=p, max_num_seqs=32,
                                                   num_kv_blocks=1024, block_size=16)) for p in config}
    burst = [SimRequest(0.0, r.prompt_len, r.output_len) for r in workload(50.0, 2.0, seed=2)]
    records, _ = run_on_engine(engines["fcfs"], burst)
    engine_capacity = len(records) / (max(r.finish for r in records) - min(r.arrival for r in records))
    speed = engine_capacity / capacity
    out.update(engine_capacity_req_s=engine_capacity, engine_speed=speed, engine_seconds=args.engine_seconds)
    eng_load = workload(1.5 * engine_capacity, args.engine_seconds, seed=1)
    for policy in ("fcfs", "vtc", "vtc", "fcfs")[:2 * args.rounds]:
        records, _ = run_on_engine(engines[policy], eng_load)
        r = SimResult(records, engines[policy].stats())
        out["engine"].setdefault(policy, []).append(summary(r))
    out["engine"]["light_ttft_bound_s"] = light_bound(config["vtc"], cost) / speed
    out["simulator_of_engine_run"] = simulate_engine_run(out, cost)
    return out


def simulate_engine_run(out: dict, cost: StepCostModel) -> dict:
    """The engine's run again in the simulator: the same requests, the cost model scaled to the engine's
    measured speed (does the simulator's fairness study match the engine's?)."""
    load = workload(1.5 * out["engine_capacity_req_s"], out["engine_seconds"], seed=1)
    scaled = cost.scaled(1 / out["engine_speed"])
    return {p: summary(simulate(load, SchedulerConfig(tenant_fairness=p, max_num_seqs=32), num_blocks=1024,
                                block_size=16, cost=scaled)) for p in ("fcfs", "vtc")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sim-seconds", type=float, default=300.0)
    ap.add_argument("--engine-seconds", type=float, default=60.0)
    ap.add_argument("--rounds", type=int, default=1, help="1: fcfs then vtc on the engine; 2: and vtc, fcfs again")
    args = ap.parse_args()
    out = run(args)
    sim, eng = out["simulator"], out["engine"]
    med = {p: {"tok_s": statistics.median(r["output_tok_s"] for r in eng[p]),
               "light_p99": statistics.median(r["tenants"]["light"]["p99_ttft_s"] for r in eng[p])}
           for p in ("fcfs", "vtc")}
    out["engine"]["median"] = med
    line = (f"heavy tenant 10x the light one at 1.5x capacity; light TTFT p99 FCFS -> VTC: simulator "
            f"{sim['fcfs']['tenants']['light']['p99_ttft_s']:.1f} -> {sim['vtc']['tenants']['light']['p99_ttft_s']:.2f} s "
            f"(bound {sim['light_ttft_bound_s']:.1f} s), engine {med['fcfs']['light_p99']:.1f} -> "
            f"{med['vtc']['light_p99']:.2f} s (bound {eng['light_ttft_bound_s']:.1f} s); throughput VTC/FCFS simulator "
            f"{sim['vtc']['output_tok_s'] / sim['fcfs']['output_tok_s']:.3f}, engine "
            f"{med['vtc']['tok_s'] / med['fcfs']['tok_s']:.3f} (medians of {args.rounds} rounds)")
    save("fairness", out, line)
    print(line)


if __name__ == "__main__":
    main()
