"""Collect confidence-head data on held-out sequences and store STS temperatures in a draft's config."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..calibration import calibration_report, reliability_plot, sequential_temperature_scaling
from ..modeling_dspark import DSparkDraftModel
from .features import target_outputs
from .losses import block_predictions
from .trainer import TrainConfig, make_batch


@torch.no_grad()
def collect_confidence_data(target, draft: DSparkDraftModel, rows: list[dict], blocks: int = 2000, seed: int = 0):
    """Teacher-forced blocks from ``rows`` -> (confidence logits [N, γ], greedy acceptance [N, γ]).

    Acceptance at slot k is 1 when the draft's argmax equals the target's (the greedy verification rule) given the
    true previous tokens; blocks running past the end of a sequence are dropped.
    """
    if draft.confidence is None:
        raise ValueError("this draft has no confidence head (confidence_head=False): nothing to calibrate")
    draft.eval()
    cfg = TrainConfig(batch_size=1, anchors=16)
    gen = torch.Generator().manual_seed(seed)
    logits, accepted = [], []
    while sum(x.shape[0] for x in logits) < blocks:
        input_ids, valid, anchors, _ = make_batch(rows, cfg, gen)
        feats, final = target_outputs(target, draft.config.target_layer_ids, input_ids, valid)
        pred = block_predictions(draft, feats, input_ids, valid, anchors, final)
        keep = pred.has_label.all(-1).flatten()
        logits.append(pred.confidence_logits.flatten(0, 1)[keep])
        accepted.append((pred.logits.argmax(-1) == pred.target_logits.argmax(-1)).float().flatten(0, 1)[keep])
    return torch.cat(logits)[:blocks], torch.cat(accepted)[:blocks]


def calibrate_draft(target, draft_dir: str | Path, rows: list[dict], blocks: int = 2000, seed: int = 0) -> dict:
    """Fit STS temperatures on ``rows``, write them into ``draft_dir``'s config (atomically) and return the report
    (also written to ``draft_dir/calibration.json``, with the reliability diagram ``draft_dir/reliability.png``)."""
    draft_dir = Path(draft_dir)
    draft = DSparkDraftModel.from_pretrained(draft_dir).attach(target)
    draft.config.sts_temperatures = None
    logits, accepted = collect_confidence_data(target, draft, rows, blocks, seed)
    temps = sequential_temperature_scaling(logits, accepted)
    report = calibration_report(logits, accepted, temps)
    report["blocks"] = int(logits.shape[0])
    draft.config.sts_temperatures = temps
    tmp = draft_dir / "config.json.tmp"
    tmp.write_text(draft.config.to_json_string())
    tmp.replace(draft_dir / "config.json")
    (draft_dir / "calibration.json").write_text(json.dumps(report, indent=2))
    reliability_plot(logits, accepted, temps, draft_dir / "reliability.png")
    return report
