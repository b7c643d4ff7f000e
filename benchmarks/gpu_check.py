"""The GPU check: the same engine on CUDA, correct and fast enough, in well under ten minutes.

Prepared for a machine with a GPU (the `device` tool of these sessions lends one to some tasks):

    python benchmarks/gpu_check.py                 # device cuda
    python benchmarks/gpu_check.py --device cpu    # the same checks on the CPU (a dry run)

1. Correctness: tiny random Llama/Qwen2/Qwen3/Mistral checkpoints on the device in fp32 — greedy
   tokens equal transformers' on the same device and weights, logits within 1e-3 of the scale
   (TF32 is disabled so that fp32 means fp32); and the demo model through the engine on the
   device equals the same engine on the CPU in fp32, token for token.
2. Speed: the reference workload (64 requests, prompts 32-256, outputs 16-256) in bf16 through
   `LLM.generate`, output tok/s.

Prints one JSON object and writes it to benchmarks/results/gpu_check.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "model"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def check_tiny_families(device: str) -> dict:
    from model_testlib import load_family, random_prompts

    from conveyor.model.loader import build_model, load_weights, read_config

    out = {}
    for name in ("llama_gqa", "qwen2", "qwen3", "mistral"):
        with tempfile.TemporaryDirectory() as tmp:
            fam = load_family(name, Path(tmp))
            hf = fam.hf.to(device)
            model = build_model(read_config(Path(tmp)), load_weights(Path(tmp)), device, torch.float32)
            prompt = random_prompts([23], seed=1)[0]
            ids = torch.tensor([prompt], device=device)
            with torch.inference_mode():
                want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                                   output_logits=True, return_dict_in_generate=True)
            got = greedy_on(model, prompt, 16, device)
            want_tokens = want.sequences[0, len(prompt):].tolist()
            want_logits = torch.cat(want.logits).float()
            err = (got["logits"] - want_logits).abs().max().item() / max(1.0, want_logits.abs().max().item())
            out[name] = {"tokens_equal": got["tokens"] == want_tokens, "max_rel_logit_error": err,
                         "ok": got["tokens"] == want_tokens and err < 1e-3}
    return out


def greedy_on(model, prompt: list[int], max_new: int, device: str) -> dict:
    """Greedy decoding through the engine core on `device`, with the logits of each step."""
    from model_testlib import conveyor_greedy

    if device == "cpu":
        run = conveyor_greedy(model, [prompt], max_new)
        return {"tokens": run.tokens[0], "logits": run.logits[0].float()}
    from conveyor.core.engine_core import EngineCore
    from conveyor.kv.manager import KVCacheManager
    from conveyor.request import Request
    from conveyor.runner.model_runner import ModelRunner
    from conveyor.sampling.params import SamplingParams
    from conveyor.scheduler.config import SchedulerConfig
    from conveyor.scheduler.scheduler import Scheduler

    runner = ModelRunner(model, 64, 16, device=device, dtype=model.dtype)
    runner.record_logits = True
    rows = []

    class Recorder:
        def swap(self, a, b):
            runner.swap(a, b)

        def execute(self, plan):
            out = runner.execute(plan)
            rows.append(runner.last_logits["g"].float().cpu())
            return out

    core = EngineCore(Scheduler(SchedulerConfig(), KVCacheManager(64, 16, enable_prefix_caching=False)), Recorder())
    req = Request("g", prompt, SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True))
    core.add_request(req)
    while core.has_unfinished():
        core.step()
    return {"tokens": req.output_token_ids, "logits": torch.stack(rows)}


def check_demo(device: str) -> dict:
    from conveyor import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = LLM(dtype="float32", num_kv_blocks=256).generate(prompts, params, use_tqdm=False)
    on_device = LLM(dtype="float32", device=device, num_kv_blocks=256).generate(prompts, params, use_tqdm=False)
    equal = [a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(ref, on_device)]
    return {"fp32_tokens_equal_cpu": equal, "ok": all(equal), "sample": on_device[0].outputs[0].text}


def throughput(device: str, dtype: str) -> dict:
    from conveyor import LLM, SamplingParams

    rng = random.Random(0)
    reqs = [([rng.randrange(100, 40000) for _ in range(rng.randint(32, 256))], rng.randint(16, 256))
            for _ in range(64)]
    llm = LLM(dtype=dtype, device=device, max_num_seqs=64, kv_cache_gib=2.0)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p, _ in reqs],
                 [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs], use_tqdm=False)
    wall = time.perf_counter() - t
    return {"dtype": dtype, "output_tok_s": sum(m for _, m in reqs) / wall, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    if args.device == "cuda":
        assert torch.cuda.is_available(), "no CUDA device here (use --device cpu for a dry run)"
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    t0 = time.perf_counter()
    result = {"device": args.device, "name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__}
    result["tiny_families"] = check_tiny_families(args.device)
    print(json.dumps(result["tiny_families"]), flush=True)
    result["demo"] = check_demo(args.device)
    print(json.dumps(result["demo"]), flush=True)
    result["throughput_bf16"] = throughput(args.device, "bfloat16")
    print(json.dumps(result["throughput_bf16"]), flush=True)
    result["ok"] = all(v["ok"] for v in result["tiny_families"].values()) and result["demo"]["ok"]
    result["wall_s"] = time.perf_counter() - t0
    if args.device != "cuda":   # a dry run: nothing to record
        print(json.dumps(result, indent=1, default=str))
        return
    from common import save

    save("gpu_check", result, f"GPU check on {result['name']}: correctness {'ok' if result['ok'] else 'FAILED'}, "
                              f"bf16 reference workload {result['throughput_bf16']['output_tok_s']:.0f} tok/s")
    print(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
