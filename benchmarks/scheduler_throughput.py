"""Batched throughput of verify modes on the embedded target (issue: confidence-scheduled verification).

    python -m benchmarks.scheduler_throughput [--draft DIR] [--rows 1 4 8 16] [--max-new-tokens 64] [--dtype auto]
                                              [--prompts 8] [--repeats 3]

For R concurrent prompts of mixed domains (first turns of gsm8k, humaneval, mt-bench, mbpp, math500; at least
``--prompts`` of them per R, run as batches of R, so a small R is not one prompt's luck): total tokens/s of
plain batched ``generate``, DSpark ``fixed`` with γ ∈ {2, 4, 8} (``verify_limit``), ``scheduled``,
``scheduled-packed`` (the paper's per-token Algorithm 1, which prices a token as one slot although this loop
verifies a padded [R, 1 + ℓ] block), ``async``, ``scheduled-tree-K`` (each row its own token tree of top-K children,
at most 16 nodes for K = 2 and 32 for K = 4 and 16), ``scheduled-lookahead`` and ``scheduled-tree-K-lookahead``
(the same with ``greedy_lookahead=True``), any scheduled one with ``-fixed-costs`` (``cost_recalibration=False``:
priced by the measured profile alone), and a measured hindsight oracle: a run in which each row verifies
exactly the draft tokens that plain greedy's output shows were going to be accepted (no rejected token is ever
verified). The oracle bounds what a verify-length policy can gain where a verify step's cost grows with its
tokens; where it does not (bfloat16 on CPUs with native bf16 units, up to ~10 tokens), verifying more costs
nothing and the oracle is no ceiling. All modes run back to back per R. Writes
``benchmarks/results/scheduler_throughput.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from benchmarks.readme_tables import replace_block
from hf_dspark import DSparkDraftModel, dspark_generate, embedded, measure_sps
from hf_dspark.decoding import costs, proposers
from hf_dspark.evaluation.evaluate import load_prompts
from hf_dspark.scheduling import chains

DOMAINS = ["gsm8k", "humaneval", "mt-bench", "mbpp", "math500"]


def mixed_prompts(n: int, offset: int = 200) -> list[str]:
    """n first-turn prompts, round-robin over domains (from line ``offset`` on, away from the test prompts)."""
    per = {d: load_prompts(d) for d in DOMAINS}
    return [per[d][(offset + i) % len(per[d])] for i in range(n) for d in [DOMAINS[i % len(DOMAINS)]]]


def batch(tokenizer, texts):
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)["input_ids"]
           for t in texts]  # fmt: skip
    width = max(len(i) for i in ids)
    pad = tokenizer.pad_token_id
    return (
        torch.tensor([[pad] * (width - len(i)) + i for i in ids]),
        torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids]),
    )


def count_new(out, width, eos):
    total = 0
    for row in out[:, width:].tolist():
        total += row.index(eos) + 1 if eos in row else len(row)
    return total


@contextmanager
def hindsight(reference: list[list[int]], diverged: set[int] | None = None):
    """The oracle: each row verifies exactly the draft tokens that match ``reference`` (plain greedy's output rows,
    same left padding), i.e. the tokens that were going to be accepted. It wraps the decoding loop's draft and
    length choice; verification itself is untouched, so the output stays exact.

    In reduced precision a row's output can part from plain greedy's at a logit tie (see ``hf-dspark bench``);
    from then on the reference no longer predicts acceptance, so that row verifies every draft token it may
    (its cap), and its index is added to ``diverged``. In float32 no row diverges."""
    real_draft, real_choose = proposers.draft_block, chains.choose_lengths
    seen = {}

    def draft_block(draft, context, histories, *args, **kwargs):
        seen["histories"], seen["rows"] = histories, draft.stats.round_rows[-1]
        seen["proposal"] = real_draft(draft, context, histories, *args, **kwargs)
        return seen["proposal"]

    def choose_lengths(mode, confidences, caps, history, sps, threshold, layout="padded", recalibration=None):
        lengths = []
        for r, cap in enumerate(caps):
            row = seen["rows"][r]  # rows leave the batch when they finish: map back to the batch index
            done, ref = seen["histories"][r].tolist(), reference[row]
            if done != ref[: len(done)]:
                if diverged is not None:
                    diverged.add(row)
                lengths.append(cap)
                continue
            drafted = seen["proposal"].tokens[r, :cap].tolist()
            n = 0
            while n < len(drafted) and len(done) + n < len(ref) and drafted[n] == ref[len(done) + n]:
                n += 1
            lengths.append(n)
        return lengths

    proposers.draft_block, chains.choose_lengths = draft_block, choose_lengths
    try:
        yield
    finally:
        proposers.draft_block, chains.choose_lengths = real_draft, real_choose


# each row its own token tree: (top-K children per node, most nodes a row verifies per round)
TREE_MODES = {"scheduled-tree-2": (2, 16), "scheduled-tree-4": (4, 32), "scheduled-tree-16": (16, 32)}


def base_mode(mode: str) -> str:
    """The mode a ``-lookahead`` mode runs with ``greedy_lookahead=True`` and a ``-fixed-costs`` mode with
    ``cost_recalibration=False`` (``scheduled-tree-16-lookahead-fixed-costs`` -> ``scheduled-tree-16``); any other
    mode is itself."""
    return mode.removesuffix("-fixed-costs").removesuffix("-lookahead")


def run_modes(
    target, draft, tokenizer, R: int, max_new_tokens: int, repeats: int = 1, prompts: int = 8, only=None
) -> dict:
    """Every mode on the same prompts in batches of R (at least ``prompts`` prompts, so a small R is not one
    prompt's luck), ``repeats`` passes; within a pass each batch runs every mode back to back (A B C … on batch 1,
    then on batch 2, …), so drift between batches hits all modes alike.
    -> {mode: {tokens, seconds, tok_per_s, pass_tok_per_s[, tau, verify_per_request, narrowed_share,
    rows_off_reference]}}; ``narrowed_share``: the rounds a tree mode drafted as chains."""
    gamma = draft.config.num_draft_tokens
    n_batches = -(-max(prompts, R) // R)
    texts = mixed_prompts(n_batches * R)
    batches = [batch(tokenizer, texts[i * R : (i + 1) * R]) for i in range(n_batches)]
    eos = tokenizer.eos_token_id
    modes = {"plain": None, **{f"fixed-{g}": ("fixed", g) for g in (2, 4, 8) if g <= gamma},
             "scheduled": ("scheduled", None), "scheduled-packed": ("scheduled", None), "async": ("async", None),
             "oracle": ("fixed", None), "scheduled+lookup": ("scheduled", None),
             **{name: ("scheduled", None) for name in TREE_MODES},
             **{f"{name}-lookahead": ("scheduled", None) for name in ("scheduled", *TREE_MODES)}}  # fmt: skip
    modes |= {f"{name}-fixed-costs": ("scheduled", None) for name in list(modes) if base_mode(name) in
              ("scheduled", *TREE_MODES)}  # fmt: skip
    if only:  # plain always runs (the oracle reads its output, and it is every ratio's baseline)
        modes = {name: setting for name, setting in modes.items() if setting is None or name in only}
    counters = ("tokens", "committed", "rounds", "narrowed", "verify_rounds")
    totals = {name: {**dict.fromkeys(counters, 0), "seconds": 0.0, "budget": [], "passes": []} for name in modes}
    references, diverged = [None] * n_batches, [set() for _ in range(n_batches)]
    for _ in range(repeats):
        for t in totals.values():
            t["passes"].append([0, 0.0])
        for b, (ids, mask) in enumerate(batches):
            for name, setting in modes.items():  # plain first: the oracle reads its output
                kw = dict(attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False)
                t0 = time.perf_counter()
                if setting is None:
                    out = target.generate(ids, **kw)
                    references[b] = out.tolist()
                else:
                    mode, limit = setting
                    tree_top_k, nodes = TREE_MODES.get(base_mode(name), (1, gamma))
                    settings = {
                        "verify_mode": mode, "verify_limit": limit or nodes, "tree_top_k": tree_top_k,
                        "verify_layout": "packed" if name.endswith("-packed") else "padded",
                        # the shipped lookup drafting, for its own row only: the others compare verify modes
                        "lookup_max_ngram": 3 if name.endswith("+lookup") else 0,
                        "greedy_lookahead": name.removesuffix("-fixed-costs").endswith("-lookahead"),
                        "cost_recalibration": not name.endswith("-fixed-costs"),
                    }  # fmt: skip
                    with hindsight(references[b], diverged[b]) if name == "oracle" else nullcontext():
                        out = target.generate(ids, custom_generate=dspark_generate, draft=draft, **settings, **kw)
                seconds, tokens = time.perf_counter() - t0, count_new(out, ids.shape[1], eos)
                t = totals[name]
                t["seconds"] += seconds
                t["tokens"] += tokens
                t["passes"][-1][0] += tokens
                t["passes"][-1][1] += seconds
                if setting is not None:
                    t["committed"] += sum(draft.stats.committed)
                    t["rounds"] += draft.stats.rounds
                    t["narrowed"] += draft.stats.narrowed_rounds
                    t["verify_rounds"] += len(draft.stats.verify_rounds)
                    t["budget"] += [x for rnd in draft.stats.verify_rounds for x in rnd]
    row = {"R": R, "prompts": n_batches * R}
    for name, t in totals.items():
        row[name] = {"tokens": t["tokens"], "seconds": t["seconds"], "tok_per_s": t["tokens"] / t["seconds"],
                     "pass_tok_per_s": [n / sec for n, sec in t["passes"]]}  # fmt: skip
        if modes[name] is not None:
            budget = t["budget"]
            row[name].update(
                tau=t["committed"] / max(t["rounds"], 1), verify_per_request=sum(budget) / max(len(budget), 1),
                narrowed_share=t["narrowed"] / max(t["verify_rounds"], 1),
            )  # fmt: skip
        if name == "oracle":
            row[name]["rows_off_reference"] = sum(len(d) for d in diverged)
        print(f"R={R:2d} {name:16s} {row[name]['tok_per_s']:7.1f} tok/s" + (
            f"  tau {row[name]['tau']:.2f}  verify/request {row[name]['verify_per_request']:.2f}"
            f"  narrowed {row[name]['narrowed_share']:.2f}"
            if modes[name] is not None else ""), flush=True)  # fmt: skip
    return row


def markdown(result: dict) -> str:
    """The table: total tokens/s per mode and R, the scheduler's verify budget, and its ratios to the goals (those
    whose modes ran: best fixed, the oracle, and the best token-tree mode against the chain)."""
    rows = result["rows"]
    names = [k for k in rows[0] if k not in ("R", "prompts")]
    trees = [k for k in names if base_mode(k) in TREE_MODES]
    fixed = [k for k in names if k.startswith("fixed")]
    ratios = {
        "scheduled / best fixed": (fixed, lambda row: _ratio(row["scheduled"], _fastest(row, fixed))),
        "scheduled / oracle": ("oracle" in names, lambda row: _ratio(row["scheduled"], row["oracle"])),
        "best tree / scheduled chain": (trees, lambda row: _ratio(_fastest(row, trees), row["scheduled"])),
    }
    ratios = {name: cell for name, (shown, cell) in ratios.items() if shown}
    head = ["R", "prompts", *names, "scheduled verify/request", *ratios]
    lines = [
        f"Measured {result['date']}, {result['dtype']}, {result['threads']} threads, "
        f"{result['max_new_tokens']} new tokens per prompt, γ = {result['gamma']}; total tokens/s over "
        f"{result.get('repeats', 1)} pass(es); each R runs its prompts in batches of R, every mode back to back on "
        "each batch. Ratio cells: over all passes (lowest–highest single pass in brackets).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for row in rows:
        cells = [str(row["R"]), str(row.get("prompts", row["R"])), *(f"{row[k]['tok_per_s']:.1f}" for k in names),
                 f"{row['scheduled']['verify_per_request']:.2f}", *(cell(row) for cell in ratios.values())]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _fastest(row: dict, names: list[str]) -> dict:
    return row[max(names, key=lambda k: row[k]["tok_per_s"])]


def _ratio(a: dict, b: dict) -> str:
    """a's tokens/s over b's, and the range of the same ratio over single passes when they were recorded."""
    text = f"{a['tok_per_s'] / b['tok_per_s']:.2f}"
    if len(a.get("pass_tok_per_s", [])) > 1:
        per_pass = [x / y for x, y in zip(a["pass_tok_per_s"], b["pass_tok_per_s"], strict=True)]
        text += f" ({min(per_pass):.2f}–{max(per_pass):.2f})"
    return text


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in [k for k in rows[0] if k not in ("R", "prompts")]:
        ax.plot([r["R"] for r in rows], [r[name]["tok_per_s"] for r in rows], marker="o", label=name)
    ax.set_xlabel("concurrent prompts R")
    ax.set_ylabel("total tokens/s")
    ax.set_title(f"SmolLM2-135M + DSpark draft, {result['dtype']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", type=Path, default=None, help="draft folder (default: the shipped draft)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="passes over all modes per R (summed)")
    ap.add_argument("--prompts", type=int, default=8, help="at least this many prompts per R, in batches of R")
    ap.add_argument("--modes", nargs="+", default=None, help="run only these modes (and plain); default: all")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="auto: bfloat16 where the CPU has native bf16 units (see embedded.fast_dtype)")  # fmt: skip
    ap.add_argument(
        "--readme",
        type=Path,
        default=None,
        help="also write the table into this page's throughput-<dtype> block (docs/results.md)",
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/scheduler_throughput.json"))
    ap.add_argument("--from-json", action="store_true", help="only rewrite the table and plot from --out")
    args = ap.parse_args()
    if args.from_json:
        result = json.loads(args.out.read_text())
    else:
        dtype = embedded.fast_dtype() if args.dtype == "auto" else getattr(torch, args.dtype)
        target, tokenizer = embedded.load_target(dtype)
        folder = args.draft or (embedded.DRAFT_DIR if embedded.has_shipped_draft() else None)
        if folder is None:
            raise SystemExit("no trained draft ships yet: pass --draft DIR")
        draft = DSparkDraftModel.from_pretrained(folder, dtype=dtype).attach(target)
        gamma = draft.config.num_draft_tokens
        # the profiles generate uses: one per batch size, on the [R, 1 + ℓ] shapes it verifies, including the
        # power-of-two sizes a batch shrinks through as rows finish; measured before any timing starts
        sizes = sorted({costs.profile_rows(n, R) for R in args.rows for n in range(1, R + 1)})
        measure_sps(draft, *sizes)  # and the draft block's own cost per size, which the scheduler adds to each round
        sps = {R: costs.sps_profile(draft, target, R).table for R in sizes}
        wanted = {base_mode(name) for name in args.modes or TREE_MODES}
        tree_draft_ms = {}
        for k, nodes in {TREE_MODES[name] for name in TREE_MODES if name in wanted}:
            for R in sizes:  # what the tree modes price with (a batch's round of drafting, a tree's and its chain's,
                # which a narrowed round pays), measured before timing
                for width in (k, 1):
                    tree_draft_ms.setdefault(width, {})[R] = 1000 * costs.tree_draft_seconds(draft, width, R)
                costs.sps_profile(draft, target, R, max_width=nodes + 1)
        draft_ms = {R: 1000 * costs.draft_seconds(draft, R) for R in sizes}
        rows = [
            run_modes(target, draft, tokenizer, R, args.max_new_tokens, args.repeats, args.prompts, args.modes)
            for R in args.rows
        ]
        result = {"date": time.strftime("%Y-%m-%d"), "dtype": str(dtype).replace("torch.", ""),
                  "threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
                  "gamma": gamma,
                  "sps": sps, "draft_ms": draft_ms, "tree_draft_ms": tree_draft_ms, "rows": rows}  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    args.out.with_suffix(".md").write_text(markdown(result))
    plot(result, args.out.with_suffix(".png"))
    if args.readme is not None:
        replace_block(args.readme, f"throughput-{result['dtype']}", markdown(result))
    print(markdown(result))
    print(f"wrote {args.out} (.md, .png)")


if __name__ == "__main__":
    main()
