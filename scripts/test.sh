#!/usr/bin/env bash
# One command: set up with test dependencies, then run the whole test suite (slow tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
. .venv/bin/activate
exec python -m pytest tests "$@"
