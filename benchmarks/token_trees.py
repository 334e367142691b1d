"""Token trees against chains, same weights: τ and speed on the shipped eval sets, side by side in one run.

    python -m benchmarks.token_trees [--datasets humaneval gsm8k mt-bench] [--limit 30] [--max-new-tokens 96]
        [--top-k 2 4] [--max-nodes 32] [--no-fixed] [--merged] [--threads 2] [--dtype float32]
        [--lookahead] [--pin-costs FILE] [--out benchmarks/results/token_trees]
        [--tau-only | --sampled-tau [--temperature 0.7] [--top-p 0.9]]

The embedded SmolLM2 target and the shipped draft, greedy, 128 new tokens by default, in float32 by default (forced
on a CPU with bfloat16 units, so the numbers compare with CPUs without them; ``--dtype bfloat16`` measures where
multi-token verifies are nearly flat in their width, on such a CPU; outputs then part from plain greedy only at
ties, which the bench checks). Methods, interleaved
prompt by prompt through ``hf-dspark bench``'s loop (every output checked against plain greedy):

    plain, prompt-lookup       transformers' own (``prompt_lookup_num_tokens=10``)
    chain-fixed                the draft alone, γ = 8 verified every round (the τ baseline)
    treeK-fixed                the draft alone, a tree of top-K children per node, at most 8·K (or --max-nodes)
                               nodes per round
    chain-scheduled+lookup     the shipped configuration before trees (scheduled, lookup replaces the block)
    treeK-scheduled+lookup     trees with lookup branches, nodes chosen by the scheduler (a row whose lookup finds
                               a continuation verifies it alone; ``-merged`` with --merged: drafted too, one tree)
    ...-lookahead              with --lookahead: the scheduled chain and trees with ``greedy_lookahead=True`` (the
                               best width of all, past a drop of the SPS profile)

Also reports the calibration of the trees' node values (expected calibration error over 10 bins, top children and
the others apart) from ``dspark_stats.tree_edges``. Prints tables and writes ``<out>/token_trees.json``;
``--report`` writes ``<out>/token_trees.md`` from it; ``--tau-only`` measures only the draft-alone τ (fixed verify, no
timing) of the chain and the trees into ``<out>/tau_only.json``; ``--sampled-tau`` the same τ when sampling
(``--temperature 0.7 --top-p 0.9`` by default; lookup off; fixed and scheduled verify, each prompt's methods drawn
from the same seed) into ``<out>/sampled_tau.json`` (exactness is the sampling tests' job: chi-square).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import hf_dspark
from hf_dspark import DSparkDraftModel
from hf_dspark.embedded import DRAFT_DIR, load_target
from hf_dspark.evaluation.bench import Method, bench, markdown_table

from .pinned_costs import pin_costs

ROOT = Path(__file__).resolve().parents[1]


def ece(pairs: list[tuple[float, bool]], bins: int = 10) -> float | None:
    """Expected calibration error of (predicted probability, outcome) pairs over equal-width bins."""
    if not pairs:
        return None
    total = 0.0
    for b in range(bins):
        inside = [(p, y) for p, y in pairs if b / bins <= p < (b + 1) / bins or (b == bins - 1 and p == 1.0)]
        if inside:
            total += abs(sum(p for p, _ in inside) - sum(y for _, y in inside))
    return total / len(pairs)


def methods(
    target, draft, top_ks: list[int], edges: dict[str, list], max_nodes: int | None = None, fixed: bool = True,
    merged: bool = False, lookahead: bool = False,
) -> list[Method]:  # fmt: skip
    """The compared methods; trees verify at most ``max_nodes`` nodes a round (default γ · K); ``fixed=False``
    leaves out the fixed-verify rows (their τ is measured on more prompts by ``--tau-only``); ``merged`` adds each
    scheduled tree with ``tree_lookup_merge=True`` (rows with a lookup continuation drafted too); ``lookahead`` adds the
    scheduled chain and each scheduled tree with ``greedy_lookahead=True`` (``-lookahead``)."""
    gamma = draft.config.num_draft_tokens

    def dspark(name: str, **settings) -> Method:
        def run(ids, **kw):
            out = target.generate(ids, custom_generate=hf_dspark.dspark_generate, draft=draft, **settings, **kw)
            edges.setdefault(name, []).extend(e for entry in draft.stats.tree_edges if entry for e in entry)
            return out

        return Method(name, run, draft)

    chosen = [
        Method("plain", lambda ids, **kw: target.generate(ids, **kw)),
        Method(
            "prompt-lookup", lambda ids, **kw: target.generate(ids, prompt_lookup_num_tokens=10, **kw), baseline=True
        ),
    ]
    if fixed:
        chosen.append(dspark("chain-fixed", verify_mode="fixed", verify_limit=gamma, lookup_max_ngram=0, tree_top_k=1))
        for k in top_ks:
            chosen.append(dspark(f"tree{k}-fixed", verify_mode="fixed", verify_limit=max_nodes or gamma * k,
                                 lookup_max_ngram=0, tree_top_k=k))  # fmt: skip
    for ahead in (False, True) if lookahead else (False,):
        tail = "-lookahead" if ahead else ""
        chosen.append(dspark(f"chain-scheduled+lookup{tail}", verify_mode="scheduled", tree_top_k=1,
                             greedy_lookahead=ahead))  # fmt: skip
        for k in top_ks:
            chosen.append(dspark(f"tree{k}-scheduled+lookup{tail}", verify_mode="scheduled", verify_limit=max_nodes,
                                 tree_top_k=k, greedy_lookahead=ahead))  # fmt: skip
    for k in top_ks:
        if merged:
            chosen.append(dspark(f"tree{k}-scheduled+lookup-merged", verify_mode="scheduled", verify_limit=max_nodes,
                                 tree_top_k=k, tree_lookup_merge=True))  # fmt: skip
    return chosen


def report(saved: dict) -> str:
    """The Markdown page of a saved run: the bench table, and the values' calibration per set."""
    st = saved["setting"]
    lines = [
        f"# Token trees against chains ({st['dtype']}, greedy, {st['limit']} prompts per set, "
        f"{st['max_new_tokens']} new tokens, {st['threads']} threads)",
        "",
        "Written by `python -m benchmarks.token_trees --report` from `token_trees.json`; methods in the script's "
        "docstring. τ = tokens committed per round.",
        "",
        markdown_table(saved["results"]),
        "",
        "Calibration of the node values (expected calibration error, 10 bins) over the verified draft nodes whose "
        "parent the walk reached; `taken` counts non-top children the target took:",
        "",
        "| dataset | method | ECE top children | ECE other children | top nodes | other nodes | other taken |",
        "|---|---|---|---|---|---|---|",
    ]
    for dataset, methods in saved["calibration"].items():
        for name, c in methods.items():
            fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
            lines.append(f"| {dataset} | {name} | {fmt(c['top'])} | {fmt(c['other'])} | {c['nodes_top']} | "
                         f"{c['nodes_other']} | {c['taken_other']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


@torch.no_grad()
def tau_only(
    target, tokenizer, draft, datasets: list[str], limit: int, max_new_tokens: int, top_ks: list[int],
    max_nodes: int | None = None,
) -> dict:  # fmt: skip
    """The draft alone, fixed verify: τ of the chain and of each tree (at most ``max_nodes`` nodes, default γ · K) on
    every prompt (no timing, no plain run; the tree's output must equal the chain's, both being plain greedy's).
    -> {dataset: {method: τ}}."""
    from hf_dspark.evaluation.evaluate import chat_ids, load_prompts

    gamma, taus = draft.config.num_draft_tokens, {}
    for dataset in datasets:
        counts = {}
        for text in load_prompts(dataset, limit):
            ids = chat_ids(tokenizer, text)
            outs = {}
            for k in [1, *top_ks]:
                name = "chain-fixed" if k == 1 else f"tree{k}-fixed"
                nodes = gamma if k == 1 else max_nodes or gamma * k
                settings = dict(verify_mode="fixed", verify_limit=nodes, lookup_max_ngram=0, tree_top_k=k)
                out = target.generate(ids, custom_generate=hf_dspark.dspark_generate, draft=draft,
                                      max_new_tokens=max_new_tokens, do_sample=False, **settings)  # fmt: skip
                outs[name] = out.tolist()
                c = counts.setdefault(name, [0, 0])
                c[0], c[1] = c[0] + sum(draft.stats.committed), c[1] + draft.stats.rounds
            if any(out != outs["chain-fixed"] for out in outs.values()):
                raise RuntimeError(f"a tree's output differs from the chain's on {dataset}: {text[:60]!r}")
        taus[dataset] = {name: c[0] / c[1] for name, c in counts.items()}
        print(dataset, {name: round(t, 3) for name, t in taus[dataset].items()}, flush=True)
    return taus


@torch.no_grad()
def sampled_tau(
    target, tokenizer, draft, datasets: list[str], limit: int, max_new_tokens: int, top_ks: list[int],
    max_nodes: int | None, temperature: float, top_p: float, seed: int = 0,
) -> dict:  # fmt: skip
    """τ of the chain and each tree (at most ``max_nodes`` nodes, default γ · K) when sampling, fixed and scheduled
    verify, lookup off: the seed is reset before every call (prompt i: ``seed + i``), so each prompt's methods start
    from the same random state (their draws part once their verifies do). -> {dataset: {method: {"tau", "wins"}}},
    ``wins`` counting the prompts whose τ beat the chain's in the same mode."""
    from hf_dspark.evaluation.evaluate import chat_ids, load_prompts

    gamma, out = draft.config.num_draft_tokens, {}
    sample = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    for dataset in datasets:
        counts: dict[str, list[int]] = {}
        per_prompt: dict[str, list[float]] = {}
        for i, text in enumerate(load_prompts(dataset, limit)):
            ids = chat_ids(tokenizer, text)
            for mode in ("fixed", "scheduled"):
                for k in [1, *top_ks]:
                    name = f"{'chain' if k == 1 else f'tree{k}'}-{mode}"
                    nodes = gamma if k == 1 else max_nodes or gamma * k
                    torch.manual_seed(seed + i)
                    target.generate(ids, custom_generate=hf_dspark.dspark_generate, draft=draft, verify_mode=mode,
                                    verify_limit=nodes, lookup_max_ngram=0, tree_top_k=k,
                                    max_new_tokens=max_new_tokens, **sample)  # fmt: skip
                    c = counts.setdefault(name, [0, 0])
                    committed, rounds = sum(draft.stats.committed), draft.stats.rounds
                    c[0], c[1] = c[0] + committed, c[1] + rounds
                    per_prompt.setdefault(name, []).append(committed / max(rounds, 1))
        out[dataset] = {
            name: {
                "tau": c[0] / c[1],
                "wins": sum(
                    t > chain
                    for t, chain in zip(per_prompt[name], per_prompt[f"chain-{name.split('-')[1]}"], strict=True)
                ),
            }
            for name, c in counts.items()
        }
        print(dataset, {name: round(v["tau"], 3) for name, v in out[dataset].items()}, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--datasets", nargs="+", default=["humaneval", "gsm8k", "mt-bench"])
    ap.add_argument("--limit", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--top-k", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--pin-costs", type=Path, default=None,
                    help="schedule with the costs pinned in this JSON (measured, written there if absent)")  # fmt: skip
    ap.add_argument("--draft", type=Path, default=DRAFT_DIR)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "token_trees")
    ap.add_argument("--report", action="store_true", help="only write <out>/token_trees.md from the saved JSON")
    ap.add_argument("--tau-only", action="store_true",
                    help="only τ of the draft alone (fixed), chain vs trees, into <out>/tau_only.json")  # fmt: skip
    ap.add_argument("--sampled-tau", action="store_true",
                    help="only τ when sampling, chain vs trees, into <out>/sampled_tau.json")  # fmt: skip
    ap.add_argument("--temperature", type=float, default=0.7, help="with --sampled-tau")
    ap.add_argument("--top-p", type=float, default=0.9, help="with --sampled-tau")
    ap.add_argument("--max-nodes", type=int, default=None,
                    help="verify at most this many nodes per tree and round (default: γ · K)")  # fmt: skip
    ap.add_argument("--no-fixed", action="store_true",
                    help="time only plain, prompt lookup and the scheduled methods")  # fmt: skip
    ap.add_argument("--merged", action="store_true",
                    help="also each scheduled tree with tree_lookup_merge=True")  # fmt: skip
    ap.add_argument("--lookahead", action="store_true",
                    help="also the scheduled chain and trees with greedy_lookahead=True")  # fmt: skip
    args = ap.parse_args()
    if args.report:
        page = report(json.loads((args.out / "token_trees.json").read_text()))
        (args.out / "token_trees.md").write_text(page)
        print(page)
        return
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(getattr(torch, args.dtype))
    draft = DSparkDraftModel.from_pretrained(args.draft).attach(target).eval()
    if args.pin_costs is not None:
        widest = max(args.max_nodes or draft.config.num_draft_tokens * k for k in args.top_k)
        pin_costs(draft, target, args.pin_costs, max_width=widest + 1, tree_top_k=args.top_k)
    if args.tau_only:
        taus = tau_only(
            target, tokenizer, draft, args.datasets, args.limit, args.max_new_tokens, args.top_k, args.max_nodes
        )
        setting = {"limit": args.limit, "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "mode": "fixed",
                   "max_nodes": args.max_nodes}  # fmt: skip
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tau_only.json").write_text(json.dumps({"setting": setting, "tau": taus}, indent=1))
        return
    if args.sampled_tau:
        taus = sampled_tau(target, tokenizer, draft, args.datasets, args.limit, args.max_new_tokens, args.top_k,
                           args.max_nodes, args.temperature, args.top_p)  # fmt: skip
        setting = {"limit": args.limit, "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
                   "temperature": args.temperature, "top_p": args.top_p, "max_nodes": args.max_nodes,
                   "lookup": False, "date": time.strftime("%F")}  # fmt: skip
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sampled_tau.json").write_text(json.dumps({"setting": setting, "tau": taus}, indent=1))
        return
    edges: dict[str, list] = {}
    chosen = methods(target, draft, args.top_k, edges, args.max_nodes, fixed=not args.no_fixed, merged=args.merged,
                     lookahead=args.lookahead)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    setting = {"draft": str(args.draft), "limit": args.limit, "max_new_tokens": args.max_new_tokens,
               "top_k": args.top_k, "dtype": args.dtype, "threads": args.threads, "max_nodes": args.max_nodes,
               "fixed": not args.no_fixed, "merged": args.merged, "lookahead": args.lookahead,
               "pinned_costs": None if args.pin_costs is None else str(args.pin_costs)}  # fmt: skip
    # one-time costs (every verify profile a tree prices with, out to its node budget) before anything is timed
    warm = tokenizer("def fibonacci(n):", return_tensors="pt")["input_ids"]
    for m in chosen:
        m.run(warm, max_new_tokens=8, do_sample=False)
    results, calibration = [], {}
    for dataset in args.datasets:
        edges.clear()
        result = bench(target, tokenizer, chosen, dataset, limit=args.limit, max_new_tokens=args.max_new_tokens)
        results.append(result)
        calibration[dataset] = {
            name: {
                "top": ece([(v, y) for v, top, y in pairs if top]),
                "other": ece([(v, y) for v, top, y in pairs if not top]),
                "nodes_top": sum(1 for _, top, _ in pairs if top),
                "nodes_other": sum(1 for _, top, _ in pairs if not top),
                "taken_other": sum(1 for _, top, y in pairs if y and not top),
            }
            for name, pairs in edges.items()
            if pairs
        }
        print(markdown_table(results[-1:]), flush=True)
        print(json.dumps(calibration[dataset], indent=1), flush=True)
        (args.out / "token_trees.json").write_text(
            json.dumps({"setting": setting, "results": results, "calibration": calibration}, indent=1)
        )
    print(markdown_table(results))


if __name__ == "__main__":
    main()
