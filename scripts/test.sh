#!/usr/bin/env bash
# Set up, lint, and run the default test suite, one pytest-xdist worker per core (timing-sensitive measurements are
# benchmarks, not tests), then the generation tests again on the oldest supported transformers release, installed
# beside the main one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
TRITON_INTERPRET=1 .venv/bin/python -m pytest -q -n auto --durations=25 "$@"
if [ "$#" -eq 0 ]; then
  # transformers 5.17 wants huggingface_hub < 2; both go into their own folder, first on the path for this run only
  OLDEST=.venv/transformers-5.17
  [ -d "$OLDEST/transformers-5.17.0.dist-info" ] || .venv/bin/pip install -q --disable-pip-version-check --no-deps \
    --target "$OLDEST" "transformers==5.17.0" "huggingface_hub<2"
  PYTHONPATH="$OLDEST" TRITON_INTERPRET=1 .venv/bin/python -m pytest -q -n auto --durations=15 tests/test_versions.py tests/test_strict_inputs.py \
    tests/test_custom_generate.py tests/test_hub.py tests/test_generation.py tests/test_batched.py tests/test_lookup.py tests/test_trees.py tests/test_lm_head.py \
    tests/test_messages.py tests/test_decoding_config.py
fi
