"""τ of the shipped configuration's scheduled chain and tree, with no clock in the loop: two commits compared.

    python -m benchmarks.scheduled_tau --pin-costs FILE [--datasets humaneval gsm8k] [--limit 4]
        [--max-new-tokens 64] [--top-k 4] [--threads 2] [--out FILE.json]

The embedded SmolLM2 target and the shipped draft, greedy, float32, the draft's own settings (scheduled verify,
lookup drafting) with the scheduler's costs pinned (:mod:`benchmarks.pinned_costs`: the same file for every run)
and ``cost_recalibration=False``, so that no decision reads a timing taken in the run. Run it on two commits (a
``git worktree`` of the older one, ``PYTHONPATH`` pointing at it) to see whether a change to the loop changed what
it decodes: the chain's rounds must then agree round for round. Prints τ per dataset and method and writes every
round's verify sizes to ``--out`` (default ``benchmarks/results/scheduled_tau.json``). The tree's rounds are not
reproducible between processes even so (repeats of one commit differ in a few rounds; see
``benchmarks/results/code_shape/README.md``), so compare trees over repeats.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hf_dspark import DSparkDraftModel, dspark_generate
from hf_dspark.embedded import DRAFT_DIR, load_target
from hf_dspark.evaluation.evaluate import chat_ids, load_prompts

from .pinned_costs import pin_costs


def scheduled_tau(target, tokenizer, draft, datasets: list[str], limit: int, max_new_tokens: int, top_k: int) -> dict:
    """-> {"<dataset> <method>": {"tau": τ, "verify_rounds": per prompt, each round's verify sizes}}."""
    results = {}
    for dataset in datasets:
        prompts = [chat_ids(tokenizer, text) for text in load_prompts(dataset, limit)]
        for name, k in (("chain-scheduled+lookup", 1), (f"tree{top_k}-scheduled+lookup", top_k)):
            committed, rounds, verified = 0, 0, []
            for ids in prompts:
                out = target.generate(
                    ids, custom_generate=dspark_generate, draft=draft, max_new_tokens=max_new_tokens, do_sample=False,
                    verify_mode="scheduled", cost_recalibration=False, tree_top_k=k, return_dict_in_generate=True,
                )  # fmt: skip
                stats = out.dspark_stats
                committed, rounds = committed + sum(stats.committed), rounds + stats.rounds
                verified.append(stats.verify_rounds)
            results[f"{dataset} {name}"] = {"tau": round(committed / rounds, 4), "verify_rounds": verified}
            print(dataset, name, round(committed / rounds, 4), flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pin-costs", type=Path, required=True, help="the pinned costs (measured, written if absent)")
    ap.add_argument("--datasets", nargs="+", default=["humaneval", "gsm8k"])
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "scheduled_tau.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(torch.float32)
    draft = DSparkDraftModel.from_pretrained(DRAFT_DIR).attach(target).eval()
    pin_costs(draft, target, args.pin_costs, max_width=draft.config.num_draft_tokens * args.top_k + 1,
              tree_top_k=[args.top_k])  # fmt: skip
    results = scheduled_tau(target, tokenizer, draft, args.datasets, args.limit, args.max_new_tokens, args.top_k)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
