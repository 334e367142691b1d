"""What one forward of the embedded target costs as a function of the tokens it processes, per dtype.

    python -m benchmarks.verify_cost [--dtypes float32 bfloat16] [--tokens 1 2 3 4 6 8 12 16 32 64]

This is the number that decides whether speculative decoding can pay on a machine: a round verifies the anchor
plus ℓ draft tokens in one forward, so the draft must commit more tokens per round than that forward costs in
one-token steps. Writes ``benchmarks/results/verify_cost.{json,md}`` (milliseconds, and cost relative to B = 1).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.readme_tables import replace_block
from hf_dspark import embedded
from hf_dspark.decoding.costs import time_verify_steps


def markdown(result: dict) -> str:
    tokens = result["tokens"]
    lines = [
        f"Measured {result['date']}, {result['threads']} threads, {result['context']}-token context; "
        "one forward over B new tokens, ms (× the cost of B = 1).",
        "",
        "| dtype | " + " | ".join(f"B = {b}" for b in tokens) + " |",
        "|---|" + "---|" * len(tokens),
    ]
    for dtype, ms in result["ms"].items():
        one = ms["1"] if "1" in ms else None
        cells = [f"{ms[str(b)]:.1f}" + (f" ({ms[str(b)] / one:.2f}×)" if one else "") for b in tokens]
        lines.append(f"| {dtype} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16, 32, 64])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument(
        "--readme",
        type=Path,
        default=None,
        help="also write the table into this page's verify-cost block (docs/results.md)",
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/verify_cost.json"))
    args = ap.parse_args()
    ms = {}
    for name in args.dtypes:
        target, _ = embedded.load_target(getattr(torch, name))
        seconds = time_verify_steps(target, args.tokens, args.context, args.reps)
        ms[name] = {str(b): 1000 * s for b, s in seconds.items()}
        print(name, {b: round(v, 1) for b, v in ms[name].items()}, flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "threads": torch.get_num_threads(), "context": args.context,
              "tokens": sorted(set(args.tokens)), "ms": ms}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    args.out.with_suffix(".md").write_text(markdown(result))
    if args.readme is not None:
        replace_block(args.readme, "verify-cost", markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
