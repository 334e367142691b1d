"""The verify modes, registered by name (``DecodingConfig.verify_mode``), each in its own file:

    fixed        every drafted token (a tree: its budget's best nodes)
    threshold    the prefix of confidences at or above a cut
    scheduled    Algorithm 1 with the SPS profile and the draft's cost
    async        capacity from confidences two rounds old, filled by current ones

Adding a mode is one file (a :class:`~hf_dspark.scheduling.modes.base.VerifyMode` subclass under ``@register``)
and its import line below (the registry lists modes in import order). The functions here are the one place the
decoding loop asks a mode anything.
"""

from __future__ import annotations

import torch

from ..policy import VERIFY_LAYOUTS, ColumnPlan, SPSProfile
from ..recalibration import AcceptanceRecalibration
from .asynchronous import Async
from .base import MODES, VerifyMode, register
from .fixed import Fixed
from .scheduled import Scheduled
from .threshold import Threshold

VERIFY_MODES = ("auto", *MODES)  # "auto": scheduled with a confidence head, else fixed
PRICED_MODES = tuple(name for name, mode in MODES.items() if mode.priced)


def verify_mode(name: str) -> VerifyMode:
    """The registered mode called ``name`` (``"auto"`` must be resolved first); ``ValueError`` naming the known ones."""
    mode = MODES.get(name)
    if mode is None:
        raise ValueError(f"verify_mode must be one of {tuple(MODES)} here, got {name!r}")
    return mode


def column_plan(
    mode: str, layout: str, caps: list[int], sps, threshold: float, recalibration=None, lookahead: bool = False
) -> ColumnPlan | None:
    """Mode ``mode``'s :class:`ColumnPlan` for a round whose rows may verify up to ``caps`` [R] tokens (drafting can
    stop where it closes), or ``None`` when it chooses from the whole block."""
    return verify_mode(mode).column_plan(caps, sps, threshold, recalibration, lookahead, layout)


def choose_lengths(
    mode: str,
    confidences: torch.Tensor | None,
    caps: list[int],
    history: list[torch.Tensor],
    sps: SPSProfile | None,
    threshold: float,
    layout: str = "padded",
    recalibration: AcceptanceRecalibration | None = None,
) -> list[int]:
    """Draft tokens each row verifies. ``caps`` [R] bound them (length limit; 0 for finished rows); confidences
    beyond a cap count as 0, so the planners never admit them. ``history`` holds past rounds' confidences
    (the asynchronous variant sizes its capacity from the one two rounds back; give them recalibrated).
    ``layout``: ``padded`` plans whole columns of the [R, 1 + ℓ] verify block this loop runs (every row then
    verifies up to its cap), ``packed`` plans tokens as the paper's Algorithm 1 does for ragged kernels
    (B = Σ_r (1 + ℓ_r)). ``recalibration``: shifts the priced modes' confidences
    (:mod:`hf_dspark.scheduling.recalibration`)."""
    if layout not in VERIFY_LAYOUTS:
        raise ValueError(f"verify_layout must be one of {VERIFY_LAYOUTS}, got {layout!r}")
    chosen = verify_mode(mode)
    if confidences is None or confidences.shape[1] == 0:
        return list(caps)
    planner = chosen.column_plan(caps, sps, threshold, recalibration, False, layout)
    if planner is None:
        return chosen.block_lengths(confidences, caps, history, sps, layout, recalibration)
    for k in range(confidences.shape[1]):
        if not planner.admit(confidences[:, k]):
            break
    return planner.lengths


def choose_tree_nodes(
    mode: str,
    values: list[float],
    sps: SPSProfile | None,
    threshold: float,
    draft_seconds: float = 0.0,
    rows: int = 1,
    generating: int = 1,
    lookahead: bool = False,
    premium: float = 1.0,
) -> tuple[int, bool]:
    """How many of a tree's best nodes to verify, ``values`` being their path values (estimated probabilities that
    the target's walk reaches them) in the order :meth:`hf_dspark.decoding.tree.TokenTree.ranked` gives them
    (ancestors first, so every prefix of that order is ancestor-closed). -> (count, whether drafting paid).

    ``fixed`` takes them all; ``threshold`` the leading ones valued ≥ ``threshold``; the priced modes run
    Algorithm 1 over nodes (:func:`~hf_dspark.scheduling.policy.priced_tree_count` says how, with ``draft_seconds``,
    ``rows``, ``generating``, ``lookahead`` and ``premium``)."""
    return verify_mode(mode).tree_count(values, sps, threshold, draft_seconds, rows, generating, lookahead, premium)


__all__ = [
    "MODES",
    "PRICED_MODES",
    "VERIFY_MODES",
    "Async",
    "Fixed",
    "Scheduled",
    "Threshold",
    "VerifyMode",
    "choose_lengths",
    "choose_tree_nodes",
    "column_plan",
    "register",
    "verify_mode",
]
