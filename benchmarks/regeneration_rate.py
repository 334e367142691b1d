"""Rows per hour of answer regeneration: plain `generate` against DSpark decoding, at the recipe's batch size and one.

    python -m benchmarks.regeneration_rate [--prompts 24] [--max-new-tokens 256] [--dtype auto] [--threads 2]

The prompts are the first of the recipe's own training mix (math, code and chat: training prompts, never
evaluation ones); every way answers them with the recipe's sampling settings (T = 0.7, top-p 0.8, top-k 20) into
a throwaway folder through ``hf_dspark.training.data.regenerate``, the code path
the recipe runs. DSpark decodes with the shipped draft as shipped (scheduled verify, lookup drafting); sampled
DSpark answers follow the target's distribution exactly, so the rows are as good for training as plain ones.
Each way runs alone, one after the other, after one warm-up call; answers differ in length, so the table reports
answer tokens per second as well as rows per hour. Writes ``benchmarks/results/regeneration/regeneration_rate.json``
and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from hf_dspark import embedded, measure_sps
from hf_dspark.evaluation.evaluate import run_context
from hf_dspark.training.data import load_dataset, regenerate

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "regeneration"


def recipe_prompts(count: int) -> list:
    """The first ``count`` prompts of the recipe's answer order (its shuffled math / code / chat mix)."""
    import runpy

    recipe = runpy.run_path(str(ROOT / "recipes" / "smollm2_prepare.py"), run_name="recipe")
    return recipe["recipe_prompts"]()[:count]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 1])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = embedded.fast_dtype() if args.dtype == "auto" else getattr(torch, args.dtype)
    target, tokenizer, draft = embedded.load(dtype)
    prompts = recipe_prompts(args.prompts)
    for rows in sorted(set(args.batch_sizes)):
        measure_sps(draft, rows, draft.config.num_draft_tokens)  # the scheduler's one-time costs, paid up front
    sampling = dict(max_new_tokens=args.max_new_tokens, do_sample=True, temperature=0.7, top_p=0.8, top_k=20)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        regenerate(target, tokenizer, prompts[:1], Path(tmp) / "warm.jsonl", progress=False, draft=draft, **sampling)
        for batch in args.batch_sizes:
            for way, with_draft in (("plain", None), ("dspark", draft)):
                torch.manual_seed(0)
                path = Path(tmp) / f"{way}-{batch}.jsonl"
                t0 = time.perf_counter()
                regenerate(target, tokenizer, prompts, path, batch_size=batch, progress=False, draft=with_draft,
                           **sampling)  # fmt: skip
                seconds = time.perf_counter() - t0
                rows = load_dataset(path)
                tokens = sum(len(r["response_ids"]) for r in rows)
                entry = {"way": way, "batch_size": batch, "rows": len(rows), "answer_tokens": tokens,
                         "seconds": round(seconds, 2), "rows_per_hour": round(len(rows) * 3600 / seconds, 1),
                         "tokens_per_s": round(tokens / seconds, 2)}  # fmt: skip
                if with_draft is not None:
                    entry["tau"] = round(with_draft.stats.tau, 3)  # the last batch's
                print(entry, flush=True)
                results.append(entry)
    context = {**run_context(target), "draft": embedded.DRAFT_DIR.name, "max_new_tokens": args.max_new_tokens,
               "sampling": "T 0.7, top-p 0.8, top-k 20", "prompts": [p.id for p in prompts]}  # fmt: skip
    base = {r["batch_size"]: r for r in results if r["way"] == "plain"}
    lines = [
        f"Measured {context['date']} on {context['machine']}, {context['threads']} threads, {context['dtype']}, "
        f"the first {len(prompts)} prompts of the recipe's training mix, up to {args.max_new_tokens} answer tokens, "
        f"sampled ({context['sampling']}).",
        "",
        "| way | batch | rows/hour | answer tok/s | vs plain at the recipe's batch | τ (last batch) |",
        "|---|---|---|---|---|---|",
    ]
    recipe_rate = base[max(base)]["tokens_per_s"]
    for r in results:
        tau = f"{r['tau']:.2f}" if "tau" in r else "-"
        lines.append(f"| {r['way']} | {r['batch_size']} | {r['rows_per_hour']:.0f} | {r['tokens_per_s']:.1f} | "
                     f"{r['tokens_per_s'] / recipe_rate:.2f}× | {tau} |")  # fmt: skip
    table = "\n".join(lines) + "\n"
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "regeneration_rate.json").write_text(json.dumps({**context, "results": results}, indent=2) + "\n")
    (args.out / "regeneration_rate.md").write_text(table)


if __name__ == "__main__":
    main()
