"""Held-out τ of training checkpoints and shipped drafts, side by side: choose what to ship without the eval sets.

    python -m recipes.smollm2_heldout --draft hf_dspark/checkpoints/smollm2-135m-instruct-dspark \\
        --run run6k-markov [--checkpoint N] [--prompts 32] [--source S] [--widen-vocab N] [--max-new-tokens 128]

Greedy DSpark decoding of the recipe's held-out prompts (never trained on; all sources, or only ``--source``'s) in
fixed mode (all γ tokens verified), bfloat16 target, the same prompts for every draft. A run checkpoint is loaded
as the ship step would load it (its draft vocabulary included), in bfloat16. ``--widen-vocab N`` adds, for every
draft, a second line with its draft vocabulary widened to the N most frequent training-answer tokens (same weights:
what a larger vocabulary is worth without training over it). Prints τ and per-position acceptance, one line per
draft.
"""

import argparse
from pathlib import Path

import torch

from hf_dspark import DSparkDraftModel, dspark_generate
from hf_dspark.decoding.stats import DSparkStats
from hf_dspark.embedded import load_target
from hf_dspark.training.data import frequent_tokens, left_pad, load_dataset
from recipes.smollm2_prepare import ANSWERS
from recipes.smollm2_ship import held_out_prompts, load_run
from recipes.smollm2_train import STATE, is_held_out


def heldout_stats(target, draft, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 8) -> DSparkStats:
    """Every round of greedy fixed-mode decoding of ``prompts`` by the draft alone (no lookup drafting, which a
    shipped config may turn on), pooled into one :class:`DSparkStats`."""
    alone = {"verify_mode": "fixed", "verify_limit": draft.config.num_draft_tokens, "lookup_max_ngram": 0,
             "tree_top_k": 1}  # fmt: skip
    pooled = DSparkStats(draft.config.block_size)
    for i in range(0, len(prompts), batch_size):
        ids, mask = left_pad(prompts[i : i + batch_size], 2)
        target.generate(
            input_ids=ids, attention_mask=mask, custom_generate=dspark_generate, draft=draft,
            max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=2, **alone,
        )  # fmt: skip
        s = draft.stats
        for p, a, c in zip(s.proposed, s.accepted, s.committed, strict=True):
            pooled.record(p, a, c)
    return pooled


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", type=Path, nargs="*", default=[], help="shipped draft folders")
    ap.add_argument("--run", nargs="*", default=[], help="training runs (their newest checkpoint, or --checkpoint)")
    ap.add_argument("--checkpoint", type=int, default=None)
    ap.add_argument("--head", default="markov")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--source", default=None, help="only held-out prompts of this source (e.g. sharegpt_prompts)")
    ap.add_argument("--widen-vocab", type=int, default=0, help="also measure with this many most frequent tokens")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target32, tokenizer = load_target()
    target, _ = load_target(torch.bfloat16)
    rows = [r for r in held_out_prompts(tokenizer) if len(r["prompt_ids"]) <= 512]
    if args.source is not None:
        rows = [r for r in rows if r["id"].split(":")[0] == args.source]
    if not rows:
        raise SystemExit(f"no held-out prompts of source {args.source!r}")
    prompts = [r["prompt_ids"] for r in rows][: args.prompts]
    drafts = {str(d): DSparkDraftModel.from_pretrained(d) for d in args.draft}
    for name in args.run:
        run = STATE / name
        draft, step = load_run(target32, tokenizer, run, args.head, args.checkpoint)
        drafts[f"{name}@{step}"] = draft
    answers = [r for r in load_dataset(ANSWERS) if not is_held_out(r)] if args.widen_vocab else []
    for name, draft in drafts.items():
        own = draft.draft_vocab
        report(name, heldout_stats(target, draft.attach(target).eval(), prompts, args.max_new_tokens), len(prompts))
        if args.widen_vocab:
            always = [*([] if own is None else own.tolist()), *tokenizer.all_special_ids]
            draft.set_draft_vocab(frequent_tokens(answers, args.widen_vocab, always=always))
            stats = heldout_stats(target, draft, prompts, args.max_new_tokens)
            report(f"{name} widened to {draft.config.draft_vocab_size} tokens", stats, len(prompts))
            draft.set_draft_vocab(own)


def report(name: str, stats: DSparkStats, prompts: int) -> None:
    acc = " ".join("-" if a is None else f"{a:.2f}" for a in stats.position_acceptance())
    print(f"{name}: {prompts} prompts, {stats.rounds} rounds, tau {stats.tau:.3f}, acceptance {acc}", flush=True)


if __name__ == "__main__":
    main()
