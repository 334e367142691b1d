#!/usr/bin/env bash
# Set up, then run DSpark generation on the embedded default (SmolLM2-135M-Instruct + our draft) and print the speedup.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m hf_dspark "$@"
