"""Learning curve of SmolLM2 training runs: held-out τ of each kept checkpoint, against steps and supervised tokens.

    python -m benchmarks.learning_curve --run run5k-markov-a96 [--run ...] [--prompts 24] [--source S] [--threads 2]
        [--dtype bfloat16|float32] [--out benchmarks/results/training/learning_curve]

For every ``checkpoint-N`` a run kept (``--milestone-every`` in the recipe) and its final draft: greedy DSpark
decoding by the draft alone (fixed γ, no lookup) of the recipe's held-out prompts (all sources, or only
``--source``'s; never trained on; not the eval sets, which stay for the final measurement), bfloat16 target (or
``--dtype float32``: cheaper on CPUs without bfloat16 units, a quick check between runs, written to
``<run>-float32.json``), 128 new tokens; the shipped draft on the same prompts is the reference line. Supervised
tokens = steps × sequences per step × anchors × γ (the (anchor, slot) pairs a run trains on; a few fall past the
end of an answer); a warm restart's steps count on from the runs it continues. Results accumulate in
``<out>/<run>.json`` (a checkpoint already measured with the same prompts is not measured again), and
``<out>/learning_curve.png`` plots them all.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hf_dspark import DSparkDraftModel
from hf_dspark.embedded import DRAFT_DIR, load_target
from recipes.smollm2_heldout import heldout_stats
from recipes.smollm2_ship import held_out_prompts, load_run, runs_before
from recipes.smollm2_train import STATE

ROOT = Path(__file__).resolve().parents[1]


def kept_steps(run: Path, every: int) -> list[int]:
    """Steps that are multiples of ``every`` with a checkpoint in ``run``, and the final draft's, ascending."""
    steps = {int(p.name.split("-")[1]) for p in run.glob("checkpoint-*")}
    steps = {s for s in steps if s % every == 0}
    final = run / "final" / "train_config.json"
    if final.is_file():
        steps.add(json.loads(final.read_text())["steps"])
    return sorted(steps)


def measure(target, draft, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """Held-out τ and per-position acceptance of ``draft`` on ``target`` (see the module docstring)."""
    stats = heldout_stats(target, draft.attach(target).eval(), prompts, max_new_tokens)
    return {"tau": round(stats.tau, 4), "rounds": stats.rounds,
            "acceptance": [None if a is None else round(a, 4) for a in stats.position_acceptance()]}  # fmt: skip


def plot(curves: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for name, curve in curves.items():
        points = sorted(curve["points"], key=lambda p: p["step"])
        parent = curves.get(curve.get("continues"))
        if parent and parent["points"]:  # a warm restart's line starts at the point it restarted from
            points.insert(0, max(parent["points"], key=lambda p: p["step"]))
        for ax, key in zip(axes, ["step", "supervised_tokens"], strict=True):
            ax.plot([p[key] for p in points], [p["tau"] for p in points], "o-", label=name)
    reference = next((c["reference"] for c in curves.values() if c.get("reference")), None)
    for ax, label in zip(axes, ["training steps", "supervised (anchor, slot) tokens"], strict=True):
        if reference:
            ref_label = f"reference: draft shipped then ({reference['tau']:.2f})"
            ax.axhline(reference["tau"], color="grey", ls="--", label=ref_label)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out τ (draft alone, fixed γ, greedy)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", action="append", required=True, help="run folder name under the recipe's state dir")
    ap.add_argument("--head", default="markov")
    ap.add_argument("--anchors", type=int, default=96, help="anchors per sequence of runs without a final config")
    ap.add_argument("--every", type=int, default=1000, help="measure checkpoints at multiples of this step")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--source", default=None, help="only held-out prompts of this source (e.g. sharegpt_prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="target and draft dtype")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "training" / "learning_curve")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target32, tokenizer = load_target()
    dtype = getattr(torch, args.dtype)
    target = target32 if dtype == torch.float32 else load_target(dtype)[0]
    rows = [r for r in held_out_prompts(tokenizer) if len(r["prompt_ids"]) <= 512]
    if args.source is not None:
        rows = [r for r in rows if r["id"].split(":")[0] == args.source]
        if not rows:
            raise SystemExit(f"no held-out prompts of source {args.source!r}")
    prompts = [r["prompt_ids"] for r in rows][: args.prompts]
    setting = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "target": args.dtype}
    if args.source is not None:  # a new key only when set, so curves measured before still compare
        setting["source"] = args.source
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.dtype == "bfloat16" else f"-{args.dtype}"  # bf16 curves keep the names they always had
    curves = {}
    for name in args.run:
        run, path = STATE / name, args.out / f"{name}{suffix}.json"
        curve = json.loads(path.read_text()) if path.is_file() else {}
        if curve.get("setting") != setting:  # other prompts: nothing measured before compares
            curve = {"setting": setting, "points": []}
        if "reference" not in curve:
            shipped = DSparkDraftModel.from_pretrained(DRAFT_DIR)
            curve["reference"] = {"draft": str(DRAFT_DIR.relative_to(ROOT))} | measure(
                target, shipped, prompts, args.max_new_tokens
            )
        final = run / "final" / "train_config.json"
        anchors = json.loads(final.read_text())["anchors"] if final.is_file() else args.anchors
        earlier = runs_before(run)  # a warm restart's steps count on from the runs it continues
        before = sum(r["steps"] for r in earlier)
        if earlier:
            curve["continues"] = earlier[-1]["run"]
        done = {p["step"] for p in curve["points"]}
        for step in kept_steps(run, args.every):
            if before + step in done:
                continue
            checkpoint = step if (run / f"checkpoint-{step}").is_dir() else None  # else the final draft
            draft, got = load_run(target32, tokenizer, run, args.head, checkpoint)
            got += before
            point = {"step": got, "supervised_tokens": got * anchors * draft.config.block_size}
            point |= measure(target, draft.to(dtype), prompts, args.max_new_tokens)
            curve["points"].append(point)
            print(f"{name}@{got}: tau {point['tau']:.3f}", flush=True)
            path.write_text(json.dumps(curve, indent=1) + "\n")
        path.write_text(json.dumps(curve, indent=1) + "\n")
        curves[name] = curve
    plot(curves, args.out / f"learning_curve{suffix}.png")
    for name, curve in curves.items():
        print(name, [(p["step"], p["tau"]) for p in sorted(curve["points"], key=lambda p: p["step"])],
              "shipped", curve["reference"]["tau"])  # fmt: skip


if __name__ == "__main__":
    main()
