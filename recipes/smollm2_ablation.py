"""The shipped draft's training, replayed with another sequential head: the ablation at the shipped budget (#48).

    python -m recipes.smollm2_ablation [--head none] [--threads 2] [--dry-run] [--eval OUT]

Reads the shipped draft's ``training.json`` ``runs`` (oldest first) and trains each again with ``--head`` in its
place, under the run name ``<head>-<run>``: the same steps, anchors, learning rate, seed, rows, layers and head rank,
each run a warm restart from the previous one's ``final`` (growing to 3 and 4 layers where the shipped chain grew).
Resumable: finished runs are skipped and an unfinished one resumes, so run the same command again after an
interruption.
With ``--eval OUT``, the finished draft is then evaluated beside the shipped one (:func:`eval_command`: draft alone,
fixed γ = 8, greedy, float32, 30 prompts of humaneval / gsm8k / mt-bench, the issue's setting) into ``OUT``, unless
``OUT/eval.json`` is there already.

Two differences from the shipped chain, both small: the shipped chain restarted three times from a *shipped*
(bfloat16-cast, STS-calibrated) draft where this one restarts from the float32 ``final``; and its first run was
started as a 5,000-step schedule and cut to 4,000 at step 1,200, where this one runs 4,000 from the start.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

from recipes.smollm2_train import STATE

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "hf_dspark" / "checkpoints" / "smollm2-135m-instruct-dspark"
FIRST_ROWS = 3872  # the answer rows that existed when the shipped chain's first run started (its training.json)


def replay_commands(runs: list[dict], head: str, threads: int, first_rows: int = FIRST_ROWS) -> list[list[str]]:
    """One ``recipes.smollm2_train`` command per shipped run (``runs``: ``training.json``'s, oldest first), with
    ``head`` instead of the shipped head, each starting from the previous replayed run's ``final``."""
    commands, previous = [], None
    for run in runs:
        weights = run["loss_weights"]
        cmd = [sys.executable, "-m", "recipes.smollm2_train", "--head", head, "--run", f"{head}-{run['run']}",
               "--steps", str(run["steps"]), "--anchors", str(run["anchors"]), "--lr", str(run["lr"]),
               "--seed", str(run["seed"]), "--rows", str(run["rows"] or first_rows), "--layers", str(run["layers"]),
               "--ce", str(weights["ce"]), "--kd", str(weights.get("kd", 0.0)),
               "--argmax", str(weights.get("argmax", 0.0)), "--head-rank", str(run.get("head_rank", 64)),
               "--threads", str(threads)]  # fmt: skip
        if previous is not None:
            cmd += ["--init-from", str(STATE / previous / "final")]
        commands.append(cmd)
        previous = f"{head}-{run['run']}"
    return commands


def eval_command(head: str, final: Path, out: Path, shipped: Path = SHIPPED) -> list[str]:
    """``hf-dspark eval`` of the replayed draft ``final`` beside the ``shipped`` one, side by side in one run: draft
    alone (no lookup), fixed verification of γ tokens, greedy, float32, 30 prompts per set, into ``out``."""
    return [sys.executable, "-m", "hf_dspark.cli", "eval", "--dtype", "float32", "--verify-mode", "fixed",
            "--temperatures", "0", "--limit", "30", "--datasets", "humaneval", "gsm8k", "mt-bench",
            "--draft", f"shipped={shipped}", f"{head}={final}", "--out", str(out)]  # fmt: skip


def run_unless(done: bool, cmd: list[str], dry_run: bool) -> None:
    """Print ``cmd`` (marked done when ``done``) and run it from the repository root unless done or a dry run."""
    print(("done: " if done else "+ ") + " ".join(cmd), flush=True)
    if not done and not dry_run:
        subprocess.run(cmd, check=True, cwd=ROOT)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--head", default="none", choices=["markov", "none", "gated", "rnn"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shipped", type=Path, default=SHIPPED, help="the draft whose training chain is replayed")
    ap.add_argument("--dry-run", action="store_true", help="print the commands only")
    ap.add_argument("--eval", type=Path, default=None, help="then evaluate beside the shipped draft into this folder")
    args = ap.parse_args()
    runs = json.loads((args.shipped / "training.json").read_text())["runs"]
    for run, cmd in zip(runs, replay_commands(runs, args.head, args.threads), strict=True):
        run_unless((STATE / f"{args.head}-{run['run']}" / "final").is_dir(), cmd, args.dry_run)
    final = STATE / f"{args.head}-{runs[-1]['run']}" / "final"
    print(f"final draft: {final}")
    if args.eval is not None:
        cmd = eval_command(args.head, final, args.eval, args.shipped)
        run_unless((args.eval / "eval.json").is_file(), cmd, args.dry_run)


if __name__ == "__main__":
    main()
