"""The prefill's last-position logits through the target's LM head, as DSpark asks for them (``logits_to_keep=1``),
with the head as ``verify_head`` routes it and as transformers leaves it, beside plain ``generate``'s prefill (every
position's logits), side by side (docs/design.md, "The head always gets one contiguous matrix").

    python -m benchmarks.prefill_head [--rows 1 8] [--dtypes bfloat16 float32] [--repeats 5]
        [--out benchmarks/results/prefill_head]

The embedded SmolLM2 on mixed first-turn prompts, left-padded into batches of R; median seconds of ``--repeats``
forwards each, after one warm-up. Writes ``<out>/prefill_head.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from benchmarks.scheduler_throughput import batch, mixed_prompts
from hf_dspark import embedded
from hf_dspark.decoding.lm_head import verify_head

WAYS = {
    "plain (all logits)": (False, False),
    "last logits, head as is": (True, False),
    "last logits, routed head": (True, True),
}


def prefill_seconds(target, ids, mask, last_only: bool, routed: bool, repeats: int) -> float:
    """Median seconds of one prefill forward of ids [R, P] (``last_only``: ``logits_to_keep=1``; ``routed``: inside
    ``verify_head``)."""
    kw = {"logits_to_keep": 1} if last_only else {}
    times = []
    with torch.no_grad(), verify_head(target) if routed else contextlib.nullcontext():
        for i in range(repeats + 1):
            start = time.perf_counter()
            target(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(), use_cache=True, **kw)
            if i:  # the first is a warm-up
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/prefill_head"))
    args = ap.parse_args()
    rows = []
    for dtype in args.dtypes:
        target, tokenizer = embedded.load_target(getattr(torch, dtype))
        for R in args.rows:
            ids, mask = batch(tokenizer, mixed_prompts(R))
            row = {"dtype": dtype, "R": R, "prompt_tokens": ids.shape[1]}
            for way, (last_only, routed) in WAYS.items():
                row[way] = prefill_seconds(target, ids, mask, last_only, routed, args.repeats)
            rows.append(row)
            print(row, flush=True)
    head = ["dtype", "R", "prompt tokens", *(f"{w} (ms)" for w in WAYS)]
    lines = [f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()}, {torch.get_num_threads()} threads, "
             f"torch {torch.__version__}; median of {args.repeats} prefill forwards each.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]  # fmt: skip
    for row in rows:
        cells = [row["dtype"], str(row["R"]), str(row["prompt_tokens"]), *(f"{1000 * row[w]:.1f}" for w in WAYS)]
        lines.append("| " + " | ".join(cells) + " |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefill_head.json").write_text(json.dumps({"repeats": args.repeats, "rows": rows}, indent=1))
    (args.out / "prefill_head.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
