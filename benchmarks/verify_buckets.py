"""What width buckets (``verify_buckets``) do to the shipped pair: the verify shapes a call runs, τ and speed.

    python -m benchmarks.verify_buckets [--pin-costs FILE] [--datasets humaneval gsm8k] [--limit 4]
        [--max-new-tokens 64] [--top-k 4] [--threads 2] [--out FILE.json]

The embedded SmolLM2 target and the shipped draft, greedy, float32, scheduled verify with the draft's own settings
(lookup drafting on), chains and trees of ``--top-k``, each prompt decoded with buckets off and on back to back
(alternating which goes first). Every verify forward's shape is recorded where the verify runs it, so the table
shows how many distinct widths a call ran (what capturing the verify as CUDA graphs, one a shape, would need) and
how many of the slots verified were padding, and whether both runs decoded the same tokens (greedy is exact whatever
is verified; only a float near-tie that the wider forward rounds the other way could part them). With
``--pin-costs`` the scheduler's costs are pinned (:mod:`benchmarks.pinned_costs`), so the runs differ only in the
buckets.
Speeds are one CPU host's: on a CPU a padded slot costs its compute, which is why the setting is off by default.
Prints a table and writes ``--out`` (default ``benchmarks/results/verify_buckets/verify_buckets.json``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hf_dspark import DSparkDraftModel, dspark_generate
from hf_dspark.decoding import verification
from hf_dspark.embedded import DRAFT_DIR, load_target
from hf_dspark.evaluation.evaluate import chat_ids, load_prompts

from .pinned_costs import pin_costs


def record_widths() -> list[tuple[int, int]]:
    """Wrap the verify's forward so every call appends its (rows, width); -> that list."""
    shapes, forward = [], verification.target_forward

    def recording(target, tokens, *args):
        shapes.append(tuple(tokens.shape))
        return forward(target, tokens, *args)

    verification.target_forward = recording
    return shapes


def run(target, draft, prompts: list[torch.Tensor], max_new_tokens: int, top_k: int, shapes: list) -> dict:
    """Each prompt with buckets off and on (alternating the order): -> per setting, τ, tok/s, shapes and slots."""
    counts = {"seconds": 0.0, "new": 0, "rounds": 0, "slots": 0, "valid": 0, "same": 0}
    totals = {b: {**counts, "widths": set()} for b in (0, 1)}
    for buckets in (False, True):  # warm up both (first calls pay one-time costs)
        target.generate(prompts[0], custom_generate=dspark_generate, draft=draft, max_new_tokens=8, do_sample=False,
                        tree_top_k=top_k, verify_buckets=buckets)  # fmt: skip
    for i, ids in enumerate(prompts):
        outputs = {}
        for buckets in (i % 2, 1 - i % 2):
            shapes.clear()
            start = time.perf_counter()
            out = target.generate(ids, custom_generate=dspark_generate, draft=draft, max_new_tokens=max_new_tokens,
                                  do_sample=False, tree_top_k=top_k, verify_buckets=bool(buckets),
                                  return_dict_in_generate=True)  # fmt: skip
            total = totals[buckets]
            total["seconds"] += time.perf_counter() - start
            stats = out.dspark_stats
            total["new"] += sum(stats.committed)
            total["rounds"] += stats.rounds
            total["widths"] |= {width for _, width in shapes}
            total["slots"] += sum(rows * width for rows, width in shapes)
            total["valid"] += sum(1 + max(lengths) for lengths in stats.verify_rounds)
            outputs[buckets] = out.sequences.tolist()
        totals[1]["same"] += outputs[0] == outputs[1]
    return {
        "buckets on" if b else "buckets off": {
            "tau": round(t["new"] / t["rounds"], 4),
            "tok_per_s": round(t["new"] / t["seconds"], 2),
            "distinct_widths": sorted(t["widths"]),
            "padding_share": round(1 - t["valid"] / t["slots"], 4),
            **({"same_tokens_as_off": f"{t['same']}/{len(prompts)}"} if b else {}),
        }
        for b, t in totals.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pin-costs", type=Path, default=None, help="pinned costs (measured and written if absent)")
    ap.add_argument("--datasets", nargs="+", default=["humaneval", "gsm8k"])
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "verify_buckets" / "verify_buckets.json"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(torch.float32)
    draft = DSparkDraftModel.from_pretrained(DRAFT_DIR).attach(target).eval()
    if args.pin_costs is not None:
        pin_costs(draft, target, args.pin_costs, max_width=draft.config.num_draft_tokens * args.top_k + 1,
                  tree_top_k=[args.top_k])  # fmt: skip
    shapes = record_widths()
    results = {}
    print("| dataset | route | buckets | τ | tok/s | distinct widths | padded slots |")
    print("|---|---|---|---|---|---|---|")
    for dataset in args.datasets:
        prompts = [chat_ids(tokenizer, text) for text in load_prompts(dataset, args.limit)]
        for route, k in (("chain", 1), (f"tree{args.top_k}", args.top_k)):
            rows = run(target, draft, prompts, args.max_new_tokens, k, shapes)
            results[f"{dataset} {route}"] = rows
            for name, r in rows.items():
                widths = f"{len(r['distinct_widths'])}: {r['distinct_widths']}"
                print(f"| {dataset} | {route} | {name} | {r['tau']} | {r['tok_per_s']} | {widths} | "
                      f"{r['padding_share']:.0%} |", flush=True)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": vars(args) | {"out": str(args.out), "pin_costs": str(args.pin_costs)},
                                    "results": results}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
