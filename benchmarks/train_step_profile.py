"""What one training step of the shipped SmolLM2 draft costs, before and after the target's features became resident
(issue: the next GPU window trains the shipped draft), measured on this CPU at the GPU batch shape scaled down.

- ``online``: the trainer's step (``hf_dspark.training.trainer.train``): batch and anchors drawn on the host, the
  target's forward on the padded batch, its whole-vocabulary statistics at the block slots in 256-slot chunks, the
  draft's forward and backward, clipping, AdamW.
- ``resident``: ``ResidentFeatures.sample`` gathers the batch from features computed once, then the same module,
  backward, clipping and AdamW (``hf_dspark.training.resident.train_for``'s step).

Per step: wall seconds (median of ``--steps`` after a warm-up, the optimizer included); for the step up to the
optimizer (which both paths share): aten operators run (each a kernel launch or more on a GPU), operators that read
device memory on the host (``_local_scalar_dense``: ``.item()``/``.tolist()``; ``equal``; ``nonzero``:
data-dependent shapes; each a host sync on a GPU), and tensors built on the host from Python lists
(``lift_fresh``; each a host-to-device copy on a GPU). Writes ``train_step_profile.json`` and ``.md``.

    python -m benchmarks.train_step_profile [--batch-size 4 --anchors 96 --steps 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from hf_dspark import DSparkDraftModel, embedded
from hf_dspark.training.data import load_dataset
from hf_dspark.training.losses import DSparkTrainingModule, LossWeights
from hf_dspark.training.resident import ResidentFeatures
from hf_dspark.training.trainer import TrainConfig, batch_generator, batch_target_outputs, make_batch, text_by_target
from recipes.smollm2_prepare import ANSWERS
from recipes.smollm2_train import is_held_out

HOST_READS = ("aten::_local_scalar_dense", "aten::equal", "aten::nonzero")


def profile(step, update, steps: int) -> dict:
    """``step()`` (batch, forward, backward, clipping) then ``update()`` (the optimizer, the same for both paths):
    seconds of both together; operators of ``step`` alone (AdamW on the CPU reads each parameter's step count on
    the host, 51 reads here, none of them a sync where the state lives on the GPU)."""
    step()  # warm-up
    update()
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        update()
        seconds.append(time.perf_counter() - start)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    update()
    names = [e.name for e in prof.events()]
    return {
        "s_per_step": round(statistics.median(seconds), 3),
        "aten_ops": sum(n.startswith("aten::") for n in names),
        "host_reads": {n.removeprefix("aten::"): names.count(n) for n in HOST_READS},
        "host_built_tensors": names.count("aten::lift_fresh"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-size", type=int, default=4, help="rows per step (the window's 32, scaled down)")
    ap.add_argument("--anchors", type=int, default=96)
    ap.add_argument("--rows", type=int, default=64, help="training rows the features are computed for")
    ap.add_argument("--max-length", type=int, default=768)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/train_step_profile"))
    args = ap.parse_args()
    torch.manual_seed(0)
    target, _ = embedded.load_target(torch.float32)
    draft = DSparkDraftModel.from_pretrained(embedded.DRAFT_DIR).attach(target).float()
    rows = [r for r in load_dataset(ANSWERS) if not is_held_out(r)][: args.rows]
    module = DSparkTrainingModule(draft, LossWeights(ce=1.0, tv=0.1, conf=1.0), draft.draft_vocab.clone())
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), fused=True)
    cfg = TrainConfig(batch_size=args.batch_size, anchors=args.anchors, max_length=args.max_length)

    def finish(out) -> None:
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)

    def update() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    count = iter(range(10**9))

    def online() -> None:
        input_ids, valid, anchors, idx = make_batch(rows, cfg, batch_generator(cfg, next(count)))
        feats, final, stats = batch_target_outputs(target, draft, rows, idx, input_ids, valid, None, cfg)
        finish(module(feats, input_ids, valid, anchors, final, stats, text_by_target(rows, idx)))

    start = time.perf_counter()
    resident = ResidentFeatures.compute(target, draft.config.target_layer_ids, rows, args.max_length)
    compute_s = time.perf_counter() - start
    rng, generator = random.Random(0), torch.Generator().manual_seed(0)

    def held() -> None:
        finish(resident.sample(args.batch_size, args.anchors, rng, generator).losses(module))

    result = {
        "date": time.strftime("%Y-%m-%d"), "threads": torch.get_num_threads(), "batch_size": args.batch_size,
        "anchors": args.anchors, "rows": len(rows), "max_length": args.max_length,
        "features_seconds": round(compute_s, 1), "features_tokens": int(resident.ids.numel()),
        "online": profile(online, update, args.steps), "resident": profile(held, update, args.steps),
    }  # fmt: skip
    lines = [
        f"Measured {result['date']}, CPU, {result['threads']} threads, float32, the shipped draft (4 layers) on "
        f"SmolLM2; {args.batch_size} rows × {args.anchors} anchors a step (the window's 32 × 96 scaled down), rows up "
        f"to {args.max_length} tokens. Resident features for {len(rows)} rows ({result['features_tokens']} tokens) "
        f"took {result['features_seconds']} s once.",
        "",
        "| step | s/step | aten ops | host reads (item / equal / nonzero) | host-built tensors |",
        "|---|---|---|---|---|",
    ]
    for name in ("online", "resident"):
        r = result[name]
        reads = " / ".join(str(r["host_reads"][k.removeprefix("aten::")]) for k in HOST_READS)
        lines.append(f"| {name} | {r['s_per_step']} | {r['aten_ops']} | {reads} | {r['host_built_tensors']} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train_step_profile.json").write_text(json.dumps(result, indent=1))
    (args.out / "train_step_profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
