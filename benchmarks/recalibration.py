"""Does per-call recalibration of the confidences pay, and with which prior and decay? Priced, not timed.

    python -m benchmarks.recalibration [--variants off on on:prior=4 on:decay=0.8] [--lookup 3] [--per-source 8]
        [--sources ...] [--eval-sets humaneval gsm8k mt-bench --limit 10] [--threads 2]
        [--out benchmarks/results/recalibration]

The shipped draft decodes each prompt greedily (float32, 128 new tokens) once per variant of the scheduler:
``off`` (the paper's: the head's STS-calibrated confidences alone), ``on``
(``hf_dspark.scheduling.recalibration`` with its defaults), ``on:prior=P,decay=D`` (other settings; ``explore=N``, a
call's first N drafted rounds verifying their whole block, was measured at commit 5e6d716 and removed:
results/recalibration/README.md). ``--lookup N``:
lookup drafting over n-grams of N..2 tokens as shipped (0: the draft alone). Every variant's output must equal
the first's (greedy float32 is exact).

Wall-clock differences between scheduler variants are a few percent, inside this 2-core machine's run-to-run
noise, so each call is *priced* instead: the verify profile and draft-block cost are measured once, at the start
(the numbers the scheduler itself plans with), and a call costs Σ over its rounds of 1 / SPS(1 + ℓ) for the
verify, plus the draft block's cost in every round that ran the draft (not in looked-up or backed-off rounds).
Plain decoding costs 1 / SPS(1) per token. The prefill (the same for all) and the loop's own per-round overhead
(``benchmarks/loop_overhead.py``) are left out, so the ratios are those of the decode steps. The decisions do not
depend on timing during the run (the profile is fixed first), so the table is reproducible and other jobs running
beside it do not change it.

Prompts: the recipe's held-out training prompts, ``--per-source`` of each source (never trained on, and not the
eval sets: settings are chosen here); ``--eval-sets`` runs the first ``--limit`` of shipped eval sets instead, to
confirm (``main-command``: the three prompts ``python -m hf_dspark`` decodes). ``--prices FILE``: price with an
earlier result's profile and draft cost instead of measuring them (the profile measured on a 2-core VM varies:
SPS(2) / SPS(1) came out 0.69 in one measurement and 0.53 in another, and at 0.53 the scheduler never drafts
here). Prints a table and writes ``<out>/recalibration_<prompts>_lookup<N>.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch

import hf_dspark
from benchmarks.lookup_length import held_out_texts
from hf_dspark import DSparkDraftModel
from hf_dspark.__main__ import SAMPLE_PROMPTS
from hf_dspark.decoding import chain, proposers
from hf_dspark.decoding.costs import measured_draft_seconds, round_prices
from hf_dspark.embedded import DRAFT_DIR, load_target
from hf_dspark.evaluation.evaluate import chat_ids, load_prompts
from hf_dspark.scheduling.policy import SPSProfile
from hf_dspark.scheduling.recalibration import AcceptanceRecalibration

ROOT = Path(__file__).resolve().parents[1]


def parse_variant(spec: str) -> tuple[bool, dict]:
    """``off`` / ``on`` / ``on:prior=4,decay=0.8`` -> (recalibrate, AcceptanceRecalibration keywords)."""
    name, _, rest = spec.partition(":")
    if name not in ("on", "off") or (name == "off" and rest):
        raise SystemExit(f"a variant is 'off', 'on' or 'on:prior=P,decay=D', got {spec!r}")
    kwargs = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in ("prior", "decay"):
            raise SystemExit(f"unknown recalibration setting {key!r} in {spec!r}")
        kwargs[key] = float(value)
    return name == "on", kwargs


def priced_call(target, draft, ids, recalibrate: bool, kwargs: dict, sps: SPSProfile, draft_s: float, new: int):
    """One greedy DSpark call under a recalibration variant -> (output ids, priced seconds, committed, rounds)."""
    ran_draft = []
    original = proposers.draft_block

    def counting(draft_, context, histories, anchors, max_tokens, *args, **kw):
        ran_draft.append(max_tokens > 0)
        return original(draft_, context, histories, anchors, max_tokens, *args, **kw)

    proposers.draft_block = counting
    chain.AcceptanceRecalibration = functools.partial(AcceptanceRecalibration, **kwargs)
    try:
        out = target.generate(
            ids, custom_generate=hf_dspark.dspark_generate, draft=draft, confidence_recalibration=recalibrate,
            max_new_tokens=new, do_sample=False,
        )  # fmt: skip
    finally:
        proposers.draft_block, chain.AcceptanceRecalibration = original, AcceptanceRecalibration
    stats = draft.stats
    widths = [1 + lengths[0] for lengths in stats.verify_rounds]
    seconds = sum(1 / sps(w) for w in widths) + draft_s * sum(ran_draft)
    return out, seconds, sum(stats.committed), stats.rounds


def run_set(name, texts, target, tokenizer, draft, variants, sps, draft_s, new) -> dict:
    totals = {v: {"priced_s": 0.0, "committed": 0, "rounds": 0} for v in variants}
    plain_s = 0.0
    for i, text in enumerate(texts):
        ids = chat_ids(tokenizer, text)
        first = None
        for v in variants:
            recalibrate, kwargs = parse_variant(v)
            out, seconds, committed, rounds = priced_call(target, draft, ids, recalibrate, kwargs, sps, draft_s, new)
            if first is None:
                first = out
                plain_s += (out.shape[1] - ids.shape[1] - 1) / sps(1)  # the prefill gives the first token
            elif out.tolist() != first.tolist():
                raise SystemExit(f"{name}[{i}]: variant {v} decoded differently from {variants[0]} (a bug)")
            totals[v]["priced_s"] += seconds
            totals[v]["committed"] += committed
            totals[v]["rounds"] += rounds
        print(f"  {name}[{i}] done", flush=True)
    return {
        "set": name,
        "prompts": len(texts),
        "variants": {
            v: {"speedup": plain_s / t["priced_s"], "tau": t["committed"] / max(t["rounds"], 1)}
            for v, t in totals.items()
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="+", default=["off", "on", "on:prior=4", "on:decay=0.8"])
    ap.add_argument("--lookup", type=int, default=3, help="lookup n-grams of N..2 tokens (0: the draft alone)")
    ap.add_argument("--per-source", type=int, default=8)
    ap.add_argument("--sources", nargs="*", default=None)
    ap.add_argument("--eval-sets", nargs="*", default=None)
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft", type=Path, default=DRAFT_DIR)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "recalibration")
    ap.add_argument("--prices", type=Path, help="price with the profile and draft cost of an earlier result JSON")
    args = ap.parse_args()
    for v in args.variants:
        parse_variant(v)
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(torch.float32)
    draft = DSparkDraftModel.from_pretrained(args.draft).attach(target).eval()
    draft.decoding.lookup_max_ngram = args.lookup  # this script's own copy of the draft: its defaults are ours to set
    widest = 1 + max(draft.config.num_draft_tokens, draft.decoding.lookup_max_tokens or 0)
    if args.prices:  # the same prices as an earlier run: its table and this one's compare decision for decision
        earlier = json.loads(args.prices.read_text())
        sps = SPSProfile.from_table({int(b): s for b, s in earlier["profile_steps_per_s"].items()})
        draft_s = earlier["draft_block_s"]
        measured_draft_seconds(draft)[(1, False, str(draft.device), draft.dtype)] = draft_s  # what the loop plans with
    else:
        sps, draft_s = round_prices(draft, target, 1, False)
    sps = SPSProfile.from_table({b: sps(b) for b in range(1, widest + 1)})
    draft.sps_profile = sps  # fixed for the whole run: the decisions no longer depend on timing
    print(
        "verify steps/s by width:", {b: round(sps(b), 2) for b in range(1, 10)}, f"draft block {draft_s * 1e3:.1f} ms"
    )
    if args.eval_sets:
        # "main-command": the prompts `python -m hf_dspark` decodes
        sets = {name: SAMPLE_PROMPTS if name == "main-command" else load_prompts(name, args.limit)
                for name in args.eval_sets}  # fmt: skip
    else:
        sets = held_out_texts(args.per_source)
        sets = {k: v for k, v in sets.items() if args.sources is None or k in args.sources}
    results = [
        run_set(name, texts, target, tokenizer, draft, args.variants, sps, draft_s, args.max_new_tokens)
        for name, texts in sets.items()
    ]
    header = "| set | " + " | ".join(f"{v} speedup / τ" for v in args.variants) + " |"
    print(header + "\n|" + "---|" * (len(args.variants) + 1))
    for r in results:
        cells = [f"{r['variants'][v]['speedup']:.3f}× / {r['variants'][v]['tau']:.2f}" for v in args.variants]
        print(f"| {r['set']} ({r['prompts']}) | " + " | ".join(cells) + " |")
    args.out.mkdir(parents=True, exist_ok=True)
    tag = "eval" if args.eval_sets else "held_out"
    path = args.out / f"recalibration_{tag}_lookup{args.lookup}.json"
    path.write_text(json.dumps({
        "profile_steps_per_s": {b: sps(b) for b in range(1, widest + 1)},
        "draft_block_s": draft_s, "lookup": args.lookup, "max_new_tokens": args.max_new_tokens,
        "draft": str(args.draft), "results": results,
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
