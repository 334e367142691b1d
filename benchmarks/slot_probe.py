"""Why is the first drafted token accepted so rarely? A probe of the SmolLM2 draft's slots on held-out answers.

    python -m benchmarks.slot_probe [--draft DIR | --run NAME] [--rows 40] [--out benchmarks/results/slot_probe.json]

Teacher-forced blocks anchored at every position of held-out answers (never trained on), float32: for each slot k,
whether the draft's argmax equals the target's (greedy acceptance of slot k given a correct prefix), binned by the
target's own top-1 probability there (is a miss a hard, near-even choice for the target, or a confident one the
draft gets wrong?), and the same blocks with every context position hidden from the draft (what reading the
target's states adds). A reference for slot 0, which sees the target's states up to the token before the anchor and
the anchor token itself: a bigram table (the most frequent next token after the anchor token in the training
answers: what the anchor token alone tells, with no context). The answers are the target's sampled ones, so a
"correct prefix" here is the sampled text, not the target's greedy one. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from itertools import pairwise
from pathlib import Path

import torch

from hf_dspark import DSparkDraftModel
from hf_dspark.embedded import DRAFT_DIR, load_target
from hf_dspark.training.data import load_dataset
from hf_dspark.training.features import target_outputs
from hf_dspark.training.losses import block_predictions
from recipes.smollm2_prepare import ANSWERS
from recipes.smollm2_ship import load_run
from recipes.smollm2_train import STATE, is_held_out

ROOT = Path(__file__).resolve().parents[1]

BINS = [0.0, 0.3, 0.5, 0.7, 0.9, 1.01]


def bigram_table(rows: list[dict]) -> dict[int, int]:
    """token -> the most frequent next token after it in the answers of ``rows``."""
    follows = defaultdict(Counter)
    for r in rows:
        seq = r["prompt_ids"][-1:] + r["response_ids"]
        for a, b in pairwise(seq):
            follows[a][b] += 1
    return {a: c.most_common(1)[0][0] for a, c in follows.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", type=Path, default=DRAFT_DIR)
    ap.add_argument("--source", default=None, help="only answers of this source (e.g. sharegpt_prompts)")
    ap.add_argument("--run", default=None, help="probe this training run's final draft (with its draft vocabulary)")
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--split", default="held-out", choices=["held-out", "train"],
                    help="held-out answers, or training ones (is a miss a failure to generalise?)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "slot_probe.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = load_dataset(ANSWERS)
    bigram = bigram_table([r for r in rows if not is_held_out(r)])
    probed = [r for r in rows if is_held_out(r) == (args.split == "held-out")]
    if args.source is not None:
        probed = [r for r in probed if r["id"].split(":")[0] == args.source]
    probed = probed[: args.rows]
    target, tokenizer = load_target()
    if args.run is None:
        draft = DSparkDraftModel.from_pretrained(args.draft).float().attach(target).eval()
    else:
        draft = load_run(target, tokenizer, STATE / args.run, "markov", None)[0].float().eval()
    vocab = draft.draft_vocab
    gamma = draft.config.block_size
    match = [[] for _ in range(gamma)]  # per slot: (agrees, target top-1 probability)
    no_context = [[] for _ in range(gamma)]  # per slot: agrees with the context hidden
    slot0 = Counter()
    for r in probed:
        ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
        valid = torch.ones_like(ids, dtype=torch.bool)
        start = len(r["prompt_ids"]) - 1
        with torch.no_grad():
            feats, final = target_outputs(target, draft.config.target_layer_ids, ids, valid)
            anchors = torch.arange(start, ids.shape[1] - gamma)[None]
            if anchors.numel() == 0:
                continue
            pred = block_predictions(draft, feats, ids, valid, anchors, final, vocab)
            # the same blocks with every context position hidden: what the draft gets from the target's states
            blind = block_predictions(draft, feats, ids, torch.zeros_like(valid), anchors, final, vocab)
            prev_top = target.get_output_embeddings()(final[0]).argmax(-1)  # the target's argmax per position
        cols = pred.logits.argmax(-1)[0]  # [A, γ]
        blind_cols = blind.logits.argmax(-1)[0]
        top_p = pred.target_logprobs[0].max(-1).values.exp()  # [A, γ]
        t_top = pred.target_top[0]
        for k in range(gamma):
            for a in range(anchors.shape[1]):
                if t_top[a, k] >= 0:
                    match[k].append((bool(cols[a, k] == t_top[a, k]), float(top_p[a, k])))
                    no_context[k].append(bool(blind_cols[a, k] == t_top[a, k]))
        for i, a in enumerate(anchors[0].tolist()):
            want = int(prev_top[a])  # the target's greedy token after the anchor: what slot 0 must propose
            slot0["positions"] += 1
            proposed = int(cols[i, 0]) if vocab is None else int(vocab[cols[i, 0]])
            slot0["draft"] += proposed == want
            slot0["bigram"] += bigram.get(int(ids[0, a]), -1) == want
    table = []
    for k in range(gamma):
        n = max(1, len(match[k]))
        row = {"slot": k + 1, "n": len(match[k]), "accept": sum(m for m, _ in match[k]) / n,
               "accept_without_context": sum(no_context[k]) / n}  # fmt: skip
        for lo, hi in pairwise(BINS):
            got = [m for m, p in match[k] if lo <= p < hi]
            row[f"p{lo:.1f}-{min(hi, 1):.1f}"] = {"share": len(got) / max(1, len(match[k])),
                                                 "accept": sum(got) / len(got) if got else None}  # fmt: skip
        table.append(row)
    n = slot0["positions"]
    probed_draft = str(args.draft) if args.run is None else f"run {args.run}"
    result = {"draft": probed_draft, "rows": len(probed), "split": args.split, "source": args.source, "slots": table,
              "slot1_references": {k: slot0[k] / n for k in ("draft", "bigram")}}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    heads = [f"p{lo:.1f}-{min(hi, 1):.1f}" for lo, hi in pairwise(BINS)]
    print(
        "| slot | greedy acceptance | without context | "
        + " | ".join(f"target top-1 {h[1:]} (share, acc.)" for h in heads)
        + " |"
    )
    print("|---" * (3 + len(heads)) + "|")
    for row in table:
        cells = [
            f"{row[h]['share']:.2f}, {row[h]['accept']:.2f}" if row[h]["accept"] is not None else "-" for h in heads
        ]
        print(
            f"| {row['slot']} | {row['accept']:.3f} | {row['accept_without_context']:.3f} | " + " | ".join(cells) + " |"
        )
    print("slot 1 against the target's greedy token, all positions:", json.dumps(result["slot1_references"]))


if __name__ == "__main__":
    main()
