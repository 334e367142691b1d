#!/usr/bin/env bash
# Measure the shipped SmolLM2 draft against its `none`-head ablation and the baselines, then write the results
# everywhere they are shown: benchmarks/results/smollm2/, the draft folder (for its model card) and the README.
#
#   LIMIT=30 DTYPE=bfloat16 bash recipes/smollm2_results.sh [path/to/none-ablation [path/to/rnn-draft]]
#
# THROUGHPUT=0 skips the batched scheduler benchmark (docs/results.md keeps its last table).
#
# Run it on an otherwise idle machine: the timings are wall-clock, and so are the SPS profiles the scheduler uses
# (a cached profile whose probe no longer matches this machine's speed is measured again).
# DTYPE defaults to bfloat16, the dtype in which a multi-token verify is cheap on CPUs with native bf16 units
# (see `hf_dspark.embedded.fast_dtype`); with DTYPE=float32 outputs are bit-identical to plain greedy.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
LIMIT=${LIMIT:-30}
DTYPE=${DTYPE:-bfloat16}
DRAFT=hf_dspark/checkpoints/smollm2-135m-instruct-dspark
NONE=${1:-$HOME/.cache/hf_dspark/smollm2/none-draft}  # recipes/smollm2_ship.py --run run3k-none --head none --out it
RNN=${2:-$HOME/.cache/hf_dspark/smollm2/rnn-draft}  # smollm2_train.py --head rnn --run run3k-rnn, then ship it
DRAFTS=("markov=$DRAFT")
[ -f "$NONE/config.json" ] && DRAFTS+=("none=$NONE")  # a missing path skips the ablation
[ -f "$RNN/config.json" ] && DRAFTS+=("rnn=$RNN")
OUT=benchmarks/results/smollm2
SETS=(humaneval gsm8k mt-bench)

[ "${THROUGHPUT:-1}" = 1 ] && PYTHONPATH=. $PY benchmarks/scheduler_throughput.py --dtype "$DTYPE" --rows 1 4 8 16 --max-new-tokens 64 --readme docs/results.md
$PY -m hf_dspark.cli eval --dtype "$DTYPE" --draft "${DRAFTS[@]}" --datasets "${SETS[@]}" \
    --limit "$LIMIT" --temperatures 0 --verify-mode fixed --out "$OUT"
$PY -m hf_dspark.cli bench --dtype "$DTYPE" --draft "${DRAFTS[@]}" --datasets "${SETS[@]}" \
    --limit "$LIMIT" --gammas 8 --lookup 3 --out "$OUT"
$PY scripts/write_results.py --eval "$OUT/eval.json" --bench "$OUT/bench.json"
cp "$OUT/eval.json" "$OUT/bench.json" "$DRAFT/"
$PY -m hf_dspark.cli card --draft "$DRAFT" --name hf-dspark/smollm2-135m-instruct-dspark \
    --target-id HuggingFaceTB/SmolLM2-135M-Instruct
