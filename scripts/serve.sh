#!/usr/bin/env bash
# One command: set up, then serve the demo model on 127.0.0.1:8000 (extra args go to `conveyor serve`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/conveyor serve "$@"
