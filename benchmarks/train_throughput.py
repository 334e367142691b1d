"""Training throughput of the SmolLM2 recipe: supervised draft positions per second on this machine.

    python -m benchmarks.train_throughput [--steps 20] [--threads 2] [--layout speculators|ours] [--flush-denormal]
        [--anchors 48] [--batch-size 1] [--out benchmarks/results/train_throughput/NAME.json]

The recipe's draft and settings (``recipes/smollm2_train.py``: 2 layers, γ = 8, 48 anchors per sequence, one
sequence per step, its draft vocabulary) on the committed regenerated answers, with the target's features cached.
Two figures: **cold**, the first ``--steps`` steps on an empty cache (every step runs the frozen target on rows it
has not seen and stores their features: what a first epoch pays), and **warm**, ``--steps`` more steps whose rows
were cached beforehand (what later epochs pay). A supervised position is one (anchor, slot) whose next token
exists; each figure is their count over its steps divided by the trainer's own clock. Run it on an otherwise idle
machine, and compare variants side by side in one session (timings here drift by 10%).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from hf_dspark.embedded import load_target
from hf_dspark.training.data import frequent_tokens, load_dataset
from hf_dspark.training.features import FeatureCache
from hf_dspark.training.losses import LossWeights
from hf_dspark.training.trainer import TrainConfig, batch_generator, make_batch, train
from recipes.smollm2_prepare import ANSWERS
from recipes.smollm2_train import build_draft, is_held_out, spare_token

ROOT = Path(__file__).resolve().parents[1]


def supervised_positions(rows: list[dict], cfg: TrainConfig, steps: range, block_size: int) -> int:
    """(anchor, slot) pairs with a next token, over the batches ``train`` draws at ``steps`` (same generators)."""
    total = 0
    for step in steps:
        _, valid, anchors, _ = make_batch(rows, cfg, batch_generator(cfg, step))
        label_pos = anchors[:, :, None] + torch.arange(block_size) + 1
        lengths = valid.sum(1)[:, None, None]
        total += int((label_pos < lengths).sum())
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layout", default="speculators", choices=["speculators", "ours"])
    ap.add_argument("--mixed-precision", default="no", choices=["no", "bf16"])
    ap.add_argument("--batch-size", type=int, default=1, help="sequences per step (the recipe: 1)")
    ap.add_argument("--anchors", type=int, default=48, help="anchors per sequence (the recipe: 48)")
    ap.add_argument("--layers", type=int, default=2, help="draft layers (the recipe: 2)")
    ap.add_argument("--flush-denormal", action="store_true", help="torch.set_flush_denormal(True) for the run")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "train_throughput" / "run.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.flush_denormal and not torch.set_flush_denormal(True):
        raise SystemExit("this CPU cannot flush denormals")
    rows = [r for r in load_dataset(ANSWERS) if not is_held_out(r)]
    target, tokenizer = load_target()
    mask_token = spare_token(tokenizer, rows) if args.layout == "speculators" else None
    draft = build_draft(target, "markov", mask_token, args.layers)
    vocab = frequent_tokens(rows, 8192, always=tokenizer.all_special_ids)
    cfg = TrainConfig(
        steps=2 * args.steps,
        lr=3e-3,
        anchors=args.anchors,
        batch_size=args.batch_size,
        max_length=768,
        save_every=10**9,
        log_every=args.steps,
        loss_weights=LossWeights(ce=1.0, tv=0.1, conf=1.0),
        mixed_precision=args.mixed_precision,
    )
    logged = []
    with tempfile.TemporaryDirectory() as tmp:
        cache, run = Path(tmp) / "features", Path(tmp) / "run"
        # steps 0..N-1 run cold (and fill the cache for their rows); then the rows steps N..2N-1 draw are cached too
        train(target, draft, rows, run, cfg, progress=False, log=logged.append, feature_cache=cache, vocab=vocab,
              stop_at=args.steps)  # fmt: skip
        features = FeatureCache(cache, target, draft.config.target_layer_ids)
        for step in range(args.steps, 2 * args.steps):
            for i in make_batch(rows, cfg, batch_generator(cfg, step))[3]:
                features.get(rows[i], cfg.max_length, "cpu")
        # the timed half: train's own clock, from after the resume to the last step (before the final save)
        train(target, draft, rows, run, cfg, progress=False, log=logged.append, feature_cache=cache, vocab=vocab)
    result = {"steps": args.steps}
    for name, log, steps in [
        ("cold", logged[0], range(args.steps)),
        ("warm", logged[-1], range(args.steps, 2 * args.steps)),
    ]:
        seconds = json.loads(log)["s_per_step"] * args.steps
        positions = supervised_positions(rows, cfg, steps, draft.config.block_size)
        result[name] = {"s_per_step": seconds / args.steps, "positions_per_s": positions / seconds}
    result |= {
        "layout": args.layout, "batch_size": args.batch_size, "anchors": args.anchors, "layers": args.layers,
        "threads": args.threads,
        "mixed_precision": args.mixed_precision,
        "flush_denormal": args.flush_denormal,
        "rows": len(rows), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
