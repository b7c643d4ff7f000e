"""One source for the engine's options, and torch-free imports of the scheduler, KV manager, engine core
(and its stats), sampling parameters and simulator."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import fields

import pytest

from conveyor.cli import build_parser
from conveyor.config import EngineConfig, add_engine_args, config_from_args, option_names
from conveyor.scheduler.config import SchedulerConfig

TORCH_FREE = """
import sys
import pickle
import conveyor, conveyor.config, conveyor.kv.manager, conveyor.scheduler.scheduler, conveyor.core.engine_core
import conveyor.core.stats, conveyor.core.trace, conveyor.scheduler.costs, conveyor.sampling.params
import conveyor.sampling.row, conveyor.request, conveyor.sim.simulator, conveyor.sim.cli, conveyor.runner.state
import conveyor.frontend.front_end, conveyor.frontend.inputs, conveyor.frontend.output_processor   # the front end
import conveyor.scheduler.stopping, conveyor.scheduler.pooling, conveyor.scheduler.prompt_logprobs
import conveyor.sampling.structured
from conveyor.scheduler.config import SchedulerConfig
from conveyor.sim.simulator import SimRequest, simulate
res = simulate([SimRequest(0.0, 20, 5, 8)], SchedulerConfig(), num_blocks=8)
assert res.output_tokens == 5 and res.stats.num_finished == 1, res
assert pickle.loads(pickle.dumps(res.stats)) == res.stats   # it crosses the process engine's pipe
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy"))
print("loaded:", bad)
sys.exit(1 if bad else 0)
"""


def test_scheduler_kv_and_simulator_import_without_torch():
    res = subprocess.run([sys.executable, "-c", TORCH_FREE], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_server_cli_imports_first_without_a_loop():
    code = "import conveyor.server.cli, conveyor.cli; conveyor.cli.build_parser()"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_option_is_a_flag_of_both_commands(command):
    flags = {o for a in _subparser(command)._actions for o in a.option_strings}
    engine_names, sched_names = option_names()
    for name in engine_names + sched_names:
        if name != "model":
            assert f"--{name.replace('_', '-')}" in flags, name


def test_flags_round_trip_into_the_config():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--max-num-seqs", "7", "--preemption-mode", "swap", "--no-enable-prefix-caching",
                         "--num-kv-blocks", "99", "--admission-quantile", "0.5", "--torch-threads", "1",
                         "--max-consecutive-step-failures", "5"])
    cfg = config_from_args(args, model="m.gguf")
    assert cfg == EngineConfig(model="m.gguf", num_kv_blocks=99, enable_prefix_caching=False, torch_threads=1,
                               max_consecutive_step_failures=5,
                               scheduler=SchedulerConfig(max_num_seqs=7, preemption_mode="swap",
                                                         admission_quantile=0.5))
    defaults = config_from_args(p.parse_args([]))
    assert defaults == EngineConfig()
    with pytest.raises(SystemExit):
        p.parse_args(["--preemption-mode", "sometimes"])


def test_keywords_reach_the_nested_config_and_unknown_ones_are_refused():
    cfg = EngineConfig.from_options(block_size=8, max_num_batched_tokens=64, admission_policy="conservative")
    assert cfg.block_size == 8 and cfg.scheduler.max_num_batched_tokens == 64
    assert cfg.scheduler.admission_policy == "conservative"
    with pytest.raises(TypeError, match="max_num_seq\\b.*the options are"):
        EngineConfig.from_options(max_num_seq=3)
    with pytest.raises(ValueError, match="preemption_mode must be one of"):
        EngineConfig.from_options(preemption_mode="never")


def test_every_option_has_help():
    for cls in (EngineConfig, SchedulerConfig):
        for f in fields(cls):
            assert f.name == "scheduler" or f.metadata.get("help"), f.name
