"""STS fitted by ECE (the paper's objective) against the Brier score, on the same decode-calibration data.

    python -m benchmarks.sts_objective [--draft DIR] [--blocks 2000] [--out benchmarks/results/sts_objective]

Collects the draft's confidence logits and outcomes the way ``recipes/smollm2_ship.py`` calibrates (greedy DSpark
decoding of the recipe's held-out prompts, bfloat16 target, every block verified), fits per-position temperatures
with each objective and reports ECE, Brier score, ROC-AUC and the mean predicted survival against the observed one
(``<out>/calibration.{json,md}``). It also writes two copies of the draft, one per temperature set, under
``<out-drafts>/{ece,brier}`` for a side-by-side wall-clock run:
``hf-dspark bench --draft ece=<out-drafts>/ece brier=<out-drafts>/brier ...``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from hf_dspark import DSparkDraftModel
from hf_dspark.embedded import DRAFT_DIR, load_target
from hf_dspark.model.sts import OBJECTIVES, calibration_report, sequential_temperature_scaling
from hf_dspark.training.calibrate import collect_decode_confidence
from recipes.smollm2_ship import held_out_prompts

ROOT = Path(__file__).resolve().parents[1]


def markdown(report: dict) -> str:
    lines = [
        f"{report['blocks']} blocks of greedy DSpark decoding ({report['draft']}, bfloat16 target), "
        "per block position k = 1..γ:",
        "",
        "| objective | temperatures | mean ECE | mean Brier | predicted survival | observed survival |",
        "|---|---|---|---|---|---|",
    ]
    observed = " ".join(f"{x:.3f}" for x in report["observed_survival"])
    for name, fit in report["fits"].items():
        temps = " ".join(f"{t:.2f}" for t in fit["temperatures"])
        pred = " ".join(f"{x:.3f}" for x in fit["predicted_survival"])
        lines.append(f"| {name} | {temps} | {fit['mean_ece']:.4f} | {fit['mean_brier']:.4f} | {pred} | {observed} |")
    auc = " ".join(f"{a:.3f}" for a in report["roc_auc"])
    return "\n".join(lines) + f"\n\nConditional ROC-AUC of c_k (the same for every temperature): {auc}\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", type=Path, default=DRAFT_DIR)
    ap.add_argument("--blocks", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "sts_objective")
    ap.add_argument("--out-drafts", type=Path, default=Path("~/.cache/hf_dspark/sts_objective").expanduser())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(torch.bfloat16)
    draft = DSparkDraftModel.from_pretrained(args.draft).attach(target)
    draft.config.sts_temperatures = None
    prompts = [r["prompt_ids"] for r in held_out_prompts(tokenizer) if len(r["prompt_ids"]) <= 512]
    logits, accepted = collect_decode_confidence(target, draft, prompts, 128, blocks=args.blocks)
    where = args.draft.resolve()
    draft_name = str(where.relative_to(ROOT)) if where.is_relative_to(ROOT) else str(where)
    report = {"draft": draft_name, "blocks": int(logits.shape[0]), "fits": {}}
    for objective in OBJECTIVES:
        temps = sequential_temperature_scaling(logits, accepted, objective=objective)
        after = calibration_report(logits, accepted, temps)
        report["observed_survival"], report["roc_auc"] = after["observed_survival"], after["after"]["roc_auc"]
        report["fits"][objective] = {"temperatures": temps} | {
            k: after["after"][k] for k in ("ece", "mean_ece", "brier", "mean_brier", "predicted_survival")
        }
        folder = args.out_drafts / objective
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(args.draft, folder)
        config = json.loads((folder / "config.json").read_text())
        config["sts_temperatures"] = temps
        (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "calibration.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "calibration.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
