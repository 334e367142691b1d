"""Per-call recalibration of the confidence head from the acceptance the call itself observes.

STS fits the head's temperatures once, on a calibration set: it makes the head right on average over many prompts,
not on the prompt at hand. A prompt can be far easier (code with a fixed shape) or harder than that average, and a
head without much resolution (every c_k near ½) then prices every block the same way, which can make the scheduler
back off from drafting on a prompt whose blocks are accepted deep (the case and its figures: docs/design.md,
"Recalibration").

:class:`AcceptanceRecalibration` keeps, for the running call, how often each block position k was accepted when it
was reached (exponentially decayed, so a long answer that turns from code to prose follows the turn), and turns it
into a logit shift δ_k for c_k: ``σ(logit c_k + δ_k)`` matches the observed rate on average while the head's
ranking of blocks within a position is unchanged. Each rate is shrunk toward a prior worth ``prior`` observations:
for position 1 the head itself (δ = 0, so a call's first round is priced by the head alone), for position k the
head shifted as position k-1 was; a position not reached yet keeps the shift of the one before it.

Lossless: the shifts come from rounds already verified, never from the tokens about to be verified.
"""

from __future__ import annotations

import math

import torch

EPS = 1e-3  # keeps rates and confidences off 0 and 1, where a logit shift is undefined


def _logit(p: float) -> float:
    p = min(max(p, EPS), 1 - EPS)
    return math.log(p / (1 - p))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


class AcceptanceRecalibration:
    """Observed acceptance per block position for one ``generate`` call -> logit shifts of the head's confidences.

    ``positions``: γ, the draft's tokens per block. ``prior``: how many observations the prior (the head, or the
    previous position's shift) counts as. ``decay``: the weight each earlier observation keeps per new drafted
    entry (0.9: about the last ten blocks matter).
    """

    def __init__(self, positions: int, prior: float = 2.0, decay: float = 0.9):
        if positions < 1:
            raise ValueError(f"positions must be >= 1, got {positions}")
        if prior <= 0 or not 0 < decay <= 1:
            raise ValueError(f"prior must be > 0 and decay in (0, 1], got prior={prior}, decay={decay}")
        self.prior, self.decay = prior, decay
        self.reached = [0.0] * positions  # weighted count of entries that verified position k with 1..k-1 accepted
        self.passed = [0.0] * positions  # ... and accepted position k
        self.predicted = [0.0] * positions  # ... the head's c_k summed over them
        self.shifts = [0.0] * positions  # δ_k, refreshed by observe
        self._shift_tensor = torch.zeros(positions, dtype=torch.float64)  # the same, built once per observe

    def observe(self, confidences: list[float], accepted: int) -> None:
        """One verified drafted entry: the head's confidences c_1..c_ℓ of the ℓ tokens it verified, n accepted."""
        if not 0 <= accepted <= len(confidences) <= len(self.shifts):
            raise ValueError(f"{accepted} accepted of {len(confidences)} verified (γ = {len(self.shifts)})")
        if not confidences:
            return
        for k in range(len(self.shifts)):
            self.reached[k] *= self.decay
            self.passed[k] *= self.decay
            self.predicted[k] *= self.decay
        for k in range(min(accepted + 1, len(confidences))):  # positions reached: 1..n+1 (n+1 was rejected)
            self.reached[k] += 1
            self.passed[k] += k < accepted
            self.predicted[k] += confidences[k]
        self._refresh()

    def _refresh(self) -> None:
        previous = 0.0  # position 1's prior is the head itself
        for k, (reached, passed, predicted) in enumerate(zip(self.reached, self.passed, self.predicted, strict=True)):
            if reached == 0:  # never reached yet (nor is any later position): keep the shift before it
                self.shifts[k] = previous
                continue
            head = predicted / reached
            expected = _sigmoid(_logit(head) + previous)  # the prior: the head, shifted as position k-1 was
            self.shifts[k] = previous = _logit((passed + self.prior * expected) / (reached + self.prior)) - _logit(head)
        self._shift_tensor = torch.tensor(self.shifts, dtype=torch.float64)

    def apply(self, confidences: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Shifted confidences: [R, G] (positions start+1..start+G) or [R] (position start+1), same shape, float64."""
        c = confidences.double()
        shifts = self._shift_tensor.to(c.device)  # applied per drafted slot: no list -> tensor on the hot path
        shifts = shifts[start : start + c.shape[-1]] if c.dim() == 2 else shifts[start]
        shifted = torch.sigmoid(torch.logit(c.clamp(EPS, 1 - EPS)) + shifts)
        return torch.where(shifts == 0, c, shifted)  # an unshifted position keeps the head's value exactly
