#!/usr/bin/env bash
# Set up, lint, and run the default test suite (slow tests are marked and run by benchmarks, not here).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
TRITON_INTERPRET=1 .venv/bin/python -m pytest -q "$@"
