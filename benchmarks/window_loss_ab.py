"""Which loss should the GPU window train with? Two warm restarts of the shipped draft at equal steps, the same seed
(the same batches and anchors), differing only in the loss: the CPU recipe's CE-heavy 1.0 CE + 0.1 TV and the
paper's 0.1 CE + 0.9 TV (both + 1.0 confidence BCE), on resident features (``hf_dspark.training.resident``), each
measured by the held-out τ proxy (teacher-forced blocks of held-out answers, never trained on) before and after.

    python -m benchmarks.window_loss_ab [--rows 100 --heldout-rows 40 --steps 150 --batch-size 2 --anchors 96]

Writes ``window_loss_ab.json`` and ``README.md``'s table into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from hf_dspark import DSparkDraftModel, embedded
from hf_dspark.training.data import load_dataset
from hf_dspark.training.resident import ResidentFeatures, train_for
from recipes.smollm2_gpu_window import LOSSES, window_training
from recipes.smollm2_prepare import ANSWERS
from recipes.smollm2_train import is_held_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=100)
    ap.add_argument("--heldout-rows", type=int, default=40)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--anchors", type=int, default=96)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/training/window_loss_ab"))
    args = ap.parse_args()
    target, _ = embedded.load_target(embedded.fast_dtype())
    answers = load_dataset(ANSWERS)
    train_rows = [r for r in answers if not is_held_out(r)][: args.rows]
    held_rows = [r for r in answers if is_held_out(r)][: args.heldout_rows]
    layers = DSparkDraftModel.from_pretrained(embedded.DRAFT_DIR).config.target_layer_ids
    start = time.time()
    train = ResidentFeatures.compute(target, layers, train_rows, 768)
    heldout = ResidentFeatures.compute(target, layers, held_rows, 768)
    features_s = time.time() - start
    arms = {}
    for name, weights in LOSSES.items():
        draft = DSparkDraftModel.from_pretrained(embedded.DRAFT_DIR).attach(target).float()
        cfg = replace(window_training(), lr=args.lr, batch_size=args.batch_size, anchors=args.anchors,
                      loss_weights=weights, milestone_seconds=10**9, heldout_batches=8, log_every=25)  # fmt: skip
        log = []
        result = train_for(draft, train, heldout, cfg, 10**9, draft.draft_vocab, lambda d, p: None, log.append,
                           max_steps=args.steps)  # fmt: skip
        arms[name] = {"loss_weights": asdict(weights), "steps": result.steps, "seconds": round(result.seconds, 1),
                      "start": result.start, "end": result.milestones[-1], "log": log}  # fmt: skip
        print(name, json.dumps({k: arms[name][k] for k in ("steps", "start", "end")}), flush=True)
    report = {"date": time.strftime("%Y-%m-%d"), "threads": torch.get_num_threads(), "dtype": str(target.dtype),
              "train_rows": train.rows, "train_tokens": int(train.ids.numel()), "heldout_rows": heldout.rows,
              "features_seconds": round(features_s, 1), "settings": vars(args) | {"out": str(args.out)},
              "arms": arms}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "window_loss_ab.json").write_text(json.dumps(report, indent=1))
    lines = [
        "| loss | steps | held-out τ proxy, start | after | change | slot 1 | slot 8 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, arm in arms.items():
        s, e, w = arm["start"], arm["end"], arm["loss_weights"]
        change = e["tau_proxy"] - s["tau_proxy"]
        lines.append(f"| {name} ({w['ce']:g} CE + {w['tv']:g} TV) | {arm['steps']} | {s['tau_proxy']:.4f} | "
                     f"{e['tau_proxy']:.4f} | {change:+.4f} | {e['slot_accept'][0]:.3f} | "
                     f"{e['slot_accept'][-1]:.3f} |")  # fmt: skip
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
