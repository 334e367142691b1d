"""A learning curve against training tokens (issue #48): the same recipe from scratch on nested fractions of the
regenerated answers, each trained for the same number of passes, then probed on the same held-out answers.

    python -m benchmarks.tokens_curve [--fractions 0.125 0.25 0.5 1] [--epochs 1] [--layers 2] [--rows 13773]
                                      [--head markov|none] [--head-rank 64]

Every arm is ``recipes/smollm2_train.py --row-fraction F --steps <passes x its rows>`` (one sequence a step), so the
compute grows with the data, as it would for more text seen the same number of times. Each is measured with
``benchmarks/slot_probe.py`` (teacher-forced blocks on 40 held-out answers, float32); τ (proxy) = 1 + Σ_k Π_{j≤k} a_j
of its per-slot greedy acceptances. Resumable: finished runs and existing probes are kept, an unfinished run resumes.
Writes ``tokens_curve.json``, ``tokens_curve.md`` and ``tokens_curve.png`` under ``--out``.
"""

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

from hf_dspark.training.data import load_dataset
from recipes.smollm2_prepare import ANSWERS
from recipes.smollm2_train import STATE, training_rows

ROOT = Path(__file__).resolve().parents[1]


def tau_proxy(probe: dict) -> float:
    """1 + Σ_k Π_{j≤k} a_j over a slot probe's per-slot acceptances: the draft-alone τ of a fixed block if slots
    were accepted independently."""
    tau, keep = 1.0, 1.0
    for slot in probe["slots"]:
        keep *= slot["accept"]
        tau += keep
    return tau


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([p["answer_tokens"] for p in points], [p["tau_proxy"] for p in points], "o-")
    for p in points:
        ax.annotate(f"{p['fraction']:g}×", (p["answer_tokens"], p["tau_proxy"]), textcoords="offset points",
                    xytext=(4, -10))  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("answer tokens trained on (one pass each)")
    ax.set_ylabel("held-out τ (proxy, γ = 8)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.125, 0.25, 0.5, 1.0])
    ap.add_argument("--epochs", type=float, default=1.0, help="passes over each arm's rows")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--anchors", type=int, default=48)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--rows", type=int, default=13773, help="the first N answer rows (the committed ones)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--head", default="markov", choices=["markov", "none"],
                    help="the sequential head; none is the ablation at the same budget")  # fmt: skip
    ap.add_argument("--head-rank", type=int, default=64, help="the sequential head's rank (the paper's: 256)")
    ap.add_argument("--prefix", default="tokens")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "training" / "tokens_curve")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    answers = load_dataset(ANSWERS)[: args.rows]
    if len(answers) < args.rows:
        raise SystemExit(f"only {len(answers)} answer rows here, {args.rows} asked for")
    points = []
    head = "" if args.head == "markov" else f"-{args.head}"  # the markov arms keep their first names
    head += "" if args.head_rank == 64 else f"-r{args.head_rank}"
    for fraction in sorted(args.fractions):
        rows = training_rows(answers, fraction)
        steps = math.ceil(args.epochs * len(rows))
        name = f"{args.prefix}{head}-f{fraction:g}-l{args.layers}-e{args.epochs:g}"
        if not (STATE / name / "final").is_dir():
            run([sys.executable, "-m", "recipes.smollm2_train", "--run", name, "--rows", str(args.rows),
                 "--row-fraction", str(fraction), "--steps", str(steps), "--layers", str(args.layers),
                 "--anchors", str(args.anchors), "--lr", str(args.lr), "--threads", str(args.threads),
                 "--head", args.head, "--head-rank", str(args.head_rank)])  # fmt: skip
        probe_path = args.out / f"slot_probe_{name}.json"
        if not probe_path.is_file():
            run([sys.executable, "-m", "benchmarks.slot_probe", "--run", name, "--rows", "40",
                 "--threads", str(args.threads), "--out", str(probe_path)])  # fmt: skip
        probe = json.loads(probe_path.read_text())
        points.append({
            "fraction": fraction, "run": name, "rows": len(rows), "steps": steps,
            "answer_tokens": sum(len(r["response_ids"]) for r in rows),
            "slot_accept": [round(s["accept"], 4) for s in probe["slots"]],
            "tau_proxy": round(tau_proxy(probe), 4),
        })  # fmt: skip
        (args.out / "tokens_curve.json").write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)},
                                                                "points": points}, indent=1))  # fmt: skip
    lines = ["| fraction | rows | answer tokens | steps | slot 1 | slot 8 | τ (proxy) | gain over the row above |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for i, p in enumerate(points):
        gain = "" if i == 0 else f"{p['tau_proxy'] - points[i - 1]['tau_proxy']:+.3f}"
        slots = p["slot_accept"]
        lines.append(f"| {p['fraction']:g}× | {p['rows']} | {p['answer_tokens']} | {p['steps']} |"
                     f" {slots[0]:.3f} | {slots[-1]:.3f} | {p['tau_proxy']:.3f} | {gain} |")  # fmt: skip
    (args.out / "tokens_curve.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(points, args.out / "tokens_curve.png")


if __name__ == "__main__":
    main()
