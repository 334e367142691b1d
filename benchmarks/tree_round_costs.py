"""Where a decoding round's time goes, chain against tree: the target's verify, the drafting, and everything else.

    python -m benchmarks.tree_round_costs [--datasets humaneval gsm8k mt-bench] [--limit 4] [--max-new-tokens 64]
        [--top-k 16] [--max-nodes 32] [--threads 2] [--dtype float32] [--pin-costs FILE]
        [--out benchmarks/results/token_trees/round_costs.json]

The embedded SmolLM2 target and the shipped draft, float32 (``--dtype bfloat16`` on a CPU with bf16 units, where a
tree and a chain may part at a tie of the logits, which stops the run), greedy, scheduled verify with lookup (the
shipped configuration), each prompt run as a chain and as a tree back to back. The loop's own functions are wrapped with
timers (no profiler, whose per-call overhead would charge the tree's extra Python calls unfairly): the target's
forward (the verify; the prompt's prefill is timed apart and left out), the round's ``propose`` (every proposer:
a chain's lookup and drafted block, a tree's backbone, expansion and lookup) and ``keep_paths`` (cache
compaction). Milliseconds per round, τ and tokens/s; every output is checked against the chain's (both are plain
greedy's). ``tree<k>-whole`` is the same tree with the expansion's schedule-aware stop turned off (every depth the
budget allows is expanded; the verified nodes are the same), and ``head_steps`` counts the sequential head's
evaluations (one a depth expanded) per round.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch

import hf_dspark
from hf_dspark import DSparkDraftModel
from hf_dspark.decoding import loop, state, verification
from hf_dspark.embedded import DRAFT_DIR, load_target
from hf_dspark.evaluation.evaluate import chat_ids, load_prompts
from hf_dspark.scheduling.trees import TreeSchedule

from .pinned_costs import pin_costs

ROOT = Path(__file__).resolve().parents[1]
# each function is wrapped where the round that calls it looks it up (the prefill's forward too: it is subtracted)
TIMED = {
    loop: ["prefill", "propose"],
    state: ["target_forward"],
    verification: ["target_forward"],
    state.DecodeState: ["keep_paths"],
}
NAMES = list(dict.fromkeys(name for names in TIMED.values() for name in names))


def timers(spent: Counter) -> None:
    """Wrap the loop's functions in ``TIMED`` so each call adds its seconds to ``spent[name]``."""
    for owner, names in TIMED.items():
        for name in names:
            real = getattr(owner, name)

            def timed(*args, _real=real, _name=name, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _real(*args, **kwargs)
                finally:
                    spent[_name] += time.perf_counter() - t0

            setattr(owner, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--datasets", nargs="+", default=["humaneval", "gsm8k", "mt-bench"])
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--max-nodes", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--pin-costs", type=Path, default=None,
                    help="schedule with the costs pinned in this JSON (measured, written there if absent)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "token_trees" / "round_costs.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(getattr(torch, args.dtype))
    draft = DSparkDraftModel.from_pretrained(DRAFT_DIR).attach(target).eval()
    if args.pin_costs is not None:
        pin_costs(draft, target, args.pin_costs, max_width=args.max_nodes + 1, tree_top_k=[args.top_k])
    tree = {"tree_top_k": args.top_k, "verify_limit": args.max_nodes}
    methods = {"chain": {"tree_top_k": 1}, f"tree{args.top_k}": tree, f"tree{args.top_k}-whole": {**tree, "whole": 1}}
    spent: Counter = Counter()
    timers(spent)
    head, settled = draft.sequential_head, TreeSchedule.settled
    real_step = head.step

    def counted_step(*args, **kwargs):
        spent["head_steps"] += 1
        return real_step(*args, **kwargs)

    head.step = counted_step

    def run(ids, max_new_tokens, settings):
        settings = dict(settings)
        TreeSchedule.settled = (lambda *a: False) if settings.pop("whole", 0) else settled
        return target.generate(ids, custom_generate=hf_dspark.dspark_generate, draft=draft, verify_mode="scheduled",
                               max_new_tokens=max_new_tokens, do_sample=False, **settings)  # fmt: skip

    warm = tokenizer("def fibonacci(n):", return_tensors="pt")["input_ids"]
    for settings in methods.values():  # profiles and drafting costs, before any timing
        run(warm, 8, settings)
    results = {}
    for dataset in args.datasets:
        totals = {name: Counter() for name in methods}
        for i, text in enumerate(load_prompts(dataset, args.limit)):
            ids = chat_ids(tokenizer, text)
            names = list(methods)[i % len(methods) :] + list(methods)[: i % len(methods)]
            outs = {}
            for name in names:
                spent.clear()
                t0 = time.perf_counter()
                outs[name] = run(ids, args.max_new_tokens, methods[name]).tolist()
                t = totals[name]
                t["seconds"] += time.perf_counter() - t0
                t.update(spent)
                t["rounds"] += draft.stats.rounds
                t["committed"] += sum(draft.stats.committed)
                t["verified"] += sum(draft.stats.proposed)
            if len({json.dumps(out) for out in outs.values()}) > 1:
                raise RuntimeError(f"the tree's output differs from the chain's on {dataset} prompt {i}")
        results[dataset] = {}
        for name, t in totals.items():
            # the prompt's prefill (one target forward a call) is left out of every per-round figure
            t["target_forward"] -= t["prefill"]
            t["seconds"] -= t["prefill"]
            per_round = {k: round(1000 * t[k] / t["rounds"], 2) for k in NAMES}
            drafting = per_round["propose"]
            known = per_round["target_forward"] + drafting + per_round["keep_paths"]
            results[dataset][name] = {
                "tok_per_s": round(t["committed"] / (t["seconds"] + t["prefill"]), 2),
                "tau": round(t["committed"] / t["rounds"], 3),
                "nodes_per_round": round(t["verified"] / t["rounds"], 2),
                "head_steps_per_round": round(t["head_steps"] / t["rounds"], 2),
                "ms_per_round": round(1000 * t["seconds"] / t["rounds"], 2),
                "target_forward_ms": per_round["target_forward"],
                "drafting_ms": round(drafting, 2),
                "keep_paths_ms": per_round["keep_paths"],
                "other_ms": round(1000 * t["seconds"] / t["rounds"] - known, 2),
            }
        print(dataset, json.dumps(results[dataset]), flush=True)
    setting = {"limit": args.limit, "max_new_tokens": args.max_new_tokens, "top_k": args.top_k,
               "max_nodes": args.max_nodes, "threads": args.threads, "dtype": args.dtype,
               "pinned_costs": None if args.pin_costs is None else str(args.pin_costs),
               "date": time.strftime("%F")}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"setting": setting, "results": results}, indent=1))
    print("| dataset | method | tok/s | τ | nodes/round | head steps/round | ms/round | verify | drafting | keep_paths "
          "| other |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for dataset, by in results.items():
        for name, r in by.items():
            print(f"| {dataset} | {name} | {r['tok_per_s']} | {r['tau']} | {r['nodes_per_round']} | "
                  f"{r['head_steps_per_round']} | "
                  f"{r['ms_per_round']} | {r['target_forward_ms']} | {r['drafting_ms']} | {r['keep_paths_ms']} | "
                  f"{r['other_ms']} |")  # fmt: skip


if __name__ == "__main__":
    main()
