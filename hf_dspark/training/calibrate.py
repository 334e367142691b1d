"""Collect confidence-head data on held-out sequences and store STS temperatures in a draft's config.

Two sources of (confidence logit, acceptance) pairs:
- ``teacher-forced``: blocks anchored inside held-out answers, acceptance = draft argmax equals the target's given
  the true previous tokens (cheap; runs in whatever dtype the draft is loaded in);
- ``decode``: real greedy DSpark decoding of held-out prompts with every block verified in full, in the dtype and
  with the draft vocabulary the draft is deployed with. This is what the scheduler sees at run time: the draft's
  own earlier tokens in the context, bfloat16 rounding, and the restricted vocabulary all shift acceptance.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..integration.generate import dspark_generate
from ..model.modeling_dspark import DSparkDraftModel
from ..model.sts import OBJECTIVES, calibration_report, sequential_temperature_scaling
from ..plotting import reliability_plot
from .data import left_pad
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
        # over the draft vocabulary when there is one: a target argmax outside it is never accepted
        pred = block_predictions(draft, feats, input_ids, valid, anchors, final, draft.draft_vocab)
        keep = pred.has_label.all(-1).flatten()
        logits.append(pred.confidence_logits.flatten(0, 1)[keep])
        accepted.append((pred.logits.argmax(-1) == pred.target_top).float().flatten(0, 1)[keep])
    return torch.cat(logits)[:blocks], torch.cat(accepted)[:blocks]


@torch.no_grad()
def collect_decode_confidence(
    target,
    draft: DSparkDraftModel,
    prompts: list[list[int]],
    max_new_tokens: int = 128,
    batch_size: int = 8,
    blocks: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy DSpark decoding of ``prompts`` (token ids, chat template applied) with ``verify_mode="fixed"`` and
    lookup drafting off:
    -> (confidence logits [N, γ], acceptance [N, γ]), one row per verified full block.

    In a round that accepted n of γ tokens, acceptance is 1 at slots < n and 0 from slot n on (slots after the first
    rejection are never judged; STS only reads "first k all accepted", which the round decides). Blocks cut short
    by the length limit are dropped; with ``blocks``, decoding stops after the batch that brings in that many rows
    (and returns the first ``blocks``). The logits are the head's own (any STS temperatures are set aside meanwhile).
    """
    if draft.confidence is None:
        raise ValueError("this draft has no confidence head (confidence_head=False): nothing to calibrate")
    if not prompts:
        raise ValueError("no prompts to decode")
    gamma = draft.config.num_draft_tokens
    # the draft's own blocks, every one verified whole (no scheduling, no lookup drafting, a chain: this call's
    # settings), and its raw confidences (the temperatures being fitted are set aside meanwhile)
    chain = {"verify_mode": "fixed", "verify_limit": gamma, "lookup_max_ngram": 0, "tree_top_k": 1}
    saved, draft.config.sts_temperatures = draft.config.sts_temperatures, None
    pad = target.generation_config.pad_token_id
    pad = pad if pad is not None else 0
    device = next(target.parameters()).device
    logits, accepted = [], []
    try:
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i : i + batch_size]
            ids, mask = left_pad(batch, pad)
            target.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), custom_generate=dspark_generate,
                draft=draft, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad, **chain,
            )  # fmt: skip
            stats = draft.stats
            for ell, n, conf in zip(stats.proposed, stats.accepted, stats.confidences, strict=True):
                if ell == gamma and conf is not None:
                    c = torch.tensor(conf, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
                    logits.append(c.log() - (-c).log1p())
                    accepted.append((torch.arange(gamma) < n).double())
            if blocks is not None and len(logits) >= blocks:
                break
    finally:
        draft.config.sts_temperatures = saved
    if not logits:
        raise ValueError(f"no full block of {gamma} was verified: use longer generations (max_new_tokens)")
    return torch.stack(logits)[:blocks], torch.stack(accepted)[:blocks]


def calibrate_draft(
    target,
    draft_dir: str | Path,
    rows: list[dict],
    blocks: int = 2000,
    seed: int = 0,
    source: str = "teacher-forced",
    max_new_tokens: int = 128,
    objective: str = "ece",
) -> dict:
    """Fit STS temperatures on ``rows`` (held-out prepared rows; ``decode`` reads only their ``prompt_ids``), write
    them into ``draft_dir``'s config (atomically) and return the report (also written to
    ``draft_dir/calibration.json``, with the reliability diagram ``draft_dir/reliability.png``).

    ``source="decode"`` runs the draft in the target's dtype, as deployed, and decodes ``rows``' prompts greedily, up to
    ``max_new_tokens`` each, until ``blocks`` full blocks are verified (see :func:`collect_decode_confidence`).
    ``objective`` is what each temperature minimises: "ece" (the paper's) or "brier" (see :mod:`hf_dspark.model.sts`).
    """
    if source not in ("teacher-forced", "decode"):
        raise ValueError(f"source must be 'teacher-forced' or 'decode', got {source!r}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    draft_dir = Path(draft_dir)
    draft = DSparkDraftModel.from_pretrained(draft_dir).attach(target)  # attach casts it to the target's dtype
    draft.config.sts_temperatures = None
    if source == "decode":
        missing = sum("prompt_ids" not in r for r in rows)
        if missing or not rows:
            raise ValueError(f"decode calibration needs rows with prompt_ids; {missing} of {len(rows)} have none")
        prompts = [r["prompt_ids"] for r in rows]
        logits, accepted = collect_decode_confidence(target, draft, prompts, max_new_tokens, blocks=blocks)
    else:
        logits, accepted = collect_confidence_data(target, draft, rows, blocks, seed)
    temps = sequential_temperature_scaling(logits, accepted, objective=objective)
    report = calibration_report(logits, accepted, temps)
    report["blocks"] = int(logits.shape[0])
    report["source"] = source
    report["objective"] = objective
    if source == "decode":
        report.update(dtype=str(target.dtype).removeprefix("torch."), max_new_tokens=max_new_tokens)
    # only the temperatures change on disk (the loaded config may carry the dtype it was loaded in)
    config = json.loads((draft_dir / "config.json").read_text())
    config["sts_temperatures"] = temps
    tmp = draft_dir / "config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tmp.replace(draft_dir / "config.json")
    (draft_dir / "calibration.json").write_text(json.dumps(report, indent=2))
    reliability_plot(logits, accepted, temps, draft_dir / "reliability.png")
    return report
