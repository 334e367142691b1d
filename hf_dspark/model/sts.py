"""Sequential temperature scaling (STS), ECE and ROC-AUC of the confidence head (docs/method.md, "Confidence head
and STS").

The scheduler needs a_k = Π_{i≤k} c_i to be the probability that the first k draft tokens all survive. STS picks,
for k = 1..γ in order and holding T_1..T_{k-1} fixed, the temperature T_k applied to the logit of c_k that
minimises the ECE of a_k against the observed "first k all accepted" outcome. A positive temperature is monotone,
so the ranking of c_k is unchanged.

ECE (the paper's objective) is also minimised by a constant prediction at the base rate: when a head is already
near calibrated, or its logits are shifted rather than over-confident, the search can run to the grid's largest
temperature, every c_k lands near ½ and the scheduler loses what the head knew about which blocks are good (the
shipped SmolLM2 draft: benchmarks/results/sts_objective/). ``objective="brier"`` minimises the Brier
score of a_k instead, a proper scoring rule that a constant cannot game (it rewards resolution as well as
calibration); the report gives both scores either way.
"""

from __future__ import annotations

import torch

DEFAULT_GRID = torch.logspace(-1.0, 1.5, 101).tolist()  # T from 0.1 to ~31.6


def ece(probs: torch.Tensor, outcomes: torch.Tensor, bins: int = 15) -> float:
    """Expected calibration error with equal-width bins: Σ_b (n_b / N) |mean p_b - mean y_b|. [N], [N] -> float."""
    probs, outcomes = probs.double().flatten(), outcomes.double().flatten()
    if probs.numel() == 0:
        return 0.0
    idx = (probs * bins).long().clamp(0, bins - 1)
    total = 0.0
    for b in range(bins):
        sel = idx == b
        if sel.any():
            total += sel.double().mean().item() * abs(probs[sel].mean().item() - outcomes[sel].mean().item())
    return total


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float | None:
    """Probability that a random positive outranks a random negative (ties count half); ``None`` if one class."""
    scores, labels = scores.double().flatten(), labels.bool().flatten()
    pos, neg = scores[labels], scores[~labels]
    if pos.numel() == 0 or neg.numel() == 0:
        return None
    ranks = torch.empty_like(scores)
    order = scores.argsort()
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=torch.double)
    for v in scores.unique():  # average ranks of ties
        tie = scores == v
        if tie.sum() > 1:
            ranks[tie] = ranks[tie].mean()
    return ((ranks[labels].sum() - pos.numel() * (pos.numel() + 1) / 2) / (pos.numel() * neg.numel())).item()


def survival(logits: torch.Tensor, temperatures: list[float] | None = None) -> torch.Tensor:
    """logits [N, γ] of c_k -> prefix survival a [N, γ] = cumprod σ(logit_k / T_k)."""
    t = torch.ones(logits.shape[-1], dtype=logits.dtype) if temperatures is None else torch.tensor(temperatures)
    return torch.sigmoid(logits / t.to(logits)).cumprod(-1)


def brier(probs: torch.Tensor, outcomes: torch.Tensor) -> float:
    """Brier score: mean (p - y)². [N], [N] -> float (0 for an empty input)."""
    probs, outcomes = probs.double().flatten(), outcomes.double().flatten()
    return ((probs - outcomes) ** 2).mean().item() if probs.numel() else 0.0


OBJECTIVES = ("ece", "brier")


def sequential_temperature_scaling(
    logits: torch.Tensor,
    accepted: torch.Tensor,
    grid: list[float] | None = None,
    bins: int = 15,
    objective: str = "ece",
) -> list[float]:
    """logits [N, γ] (confidence logits per block position), accepted [N, γ] (1 where draft token k survived given
    1..k-1 did, per block; positions after a rejection may hold anything) -> temperatures [γ], each minimising
    ``objective`` ("ece", the paper's, or "brier") of the prefix survival a_k."""
    if logits.shape != accepted.shape or logits.dim() != 2:
        raise ValueError(
            f"logits and accepted must both be [N, γ], got {tuple(logits.shape)} and {tuple(accepted.shape)}"
        )
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    score = (lambda p, y: ece(p, y, bins)) if objective == "ece" else brier
    grid = grid or DEFAULT_GRID
    outcome = accepted.double().cumprod(-1)  # first k all accepted
    temps: list[float] = []
    prefix = torch.ones(logits.shape[0], dtype=torch.double)
    for k in range(logits.shape[1]):
        best = min(grid, key=lambda t: score(prefix * torch.sigmoid(logits[:, k].double() / t), outcome[:, k]))
        temps.append(float(best))
        prefix = prefix * torch.sigmoid(logits[:, k].double() / best)
    return temps


def calibration_report(logits: torch.Tensor, accepted: torch.Tensor, temperatures: list[float] | None) -> dict:
    """Per-position ECE and Brier score of the prefix survival, its mean prediction (``predicted_survival``: mean
    a_k, what the scheduler expects) and conditional ROC-AUC of c_k (among blocks whose first k-1 tokens survived),
    before (T = 1) and after (``temperatures``); ``observed_survival``: the fraction of blocks whose first k tokens
    all survived."""
    outcome = accepted.double().cumprod(-1)
    reached = torch.cat([torch.ones_like(outcome[:, :1]), outcome[:, :-1]], dim=1).bool()
    report = {}
    for name, temps in (("before", None), ("after", temperatures)):
        a = survival(logits.double(), temps)
        eces = [ece(a[:, k], outcome[:, k]) for k in range(a.shape[1])]
        briers = [brier(a[:, k], outcome[:, k]) for k in range(a.shape[1])]
        aucs = [roc_auc(logits[reached[:, k], k], accepted[reached[:, k], k]) for k in range(a.shape[1])]
        report[name] = {"ece": eces, "mean_ece": sum(eces) / len(eces), "brier": briers,
                        "mean_brier": sum(briers) / len(briers), "roc_auc": aucs,
                        "predicted_survival": a.mean(0).tolist()}  # fmt: skip
    report["observed_survival"] = outcome.mean(0).tolist()
    report["temperatures"] = temperatures
    return report


def reliability_bins(probs: torch.Tensor, outcomes: torch.Tensor, bins: int = 15) -> list[tuple[float, float, int]]:
    """Non-empty equal-width bins of ``probs`` [N]: (mean predicted, observed frequency, count) per bin."""
    probs, outcomes = probs.double().flatten(), outcomes.double().flatten()
    idx = (probs * bins).long().clamp(0, bins - 1)
    out = []
    for b in range(bins):
        sel = idx == b
        if sel.any():
            out.append((probs[sel].mean().item(), outcomes[sel].mean().item(), int(sel.sum())))
    return out
