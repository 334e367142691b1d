"""What a verify mode is, and the registry of them by name.

A mode decides how much of a round's proposal each row verifies, for chains (a length per row, column by column
as the draft produces them or from the whole block) and for trees (how many of the ranked nodes). Each mode is one
class in its own file, registered by its ``verify_mode`` name with :func:`register`; ``modes/__init__.py`` imports
the files and dispatches to them.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..policy import ColumnPlan, SPSProfile
from ..recalibration import AcceptanceRecalibration


class VerifyMode:
    """One verify mode. ``name``: its ``verify_mode`` value; ``priced``: whether it prices rounds (the SPS profile,
    the draft's cost, back-off, recalibration). The defaults verify everything a row may."""

    name: ClassVar[str]
    priced: ClassVar[bool] = False

    def column_plan(
        self,
        caps: list[int],
        sps: SPSProfile | None,
        threshold: float,
        recalibration: AcceptanceRecalibration | None = None,
        lookahead: bool = False,
        layout: str = "padded",
    ) -> ColumnPlan | None:
        """A plan fed the draft's confidence columns as they come, which closes at the first column no row verifies
        (drafting stops there); ``None``: the mode chooses from the whole block (:meth:`block_lengths`). ``caps``
        [R] bound each row (0: it drafts nothing), ``sps`` prices a verify step (with the draft's cost added)."""
        return None

    def block_lengths(
        self,
        confidences: torch.Tensor,
        caps: list[int],
        history: list[torch.Tensor],
        sps: SPSProfile | None,
        layout: str,
        recalibration: AcceptanceRecalibration | None,
    ) -> list[int]:
        """Draft tokens each row verifies, from the whole drafted block's ``confidences`` [R, γ] (``history``: the
        call's earlier drafted rounds' confidences, recalibrated, oldest first)."""
        return list(caps)

    def tree_count(self, values: list[float], sps: SPSProfile | None, threshold: float, *priced) -> tuple[int, bool]:
        """How many of a tree's ranked nodes to verify (``values``: their path values, ancestors first), and whether
        drafting paid for itself. ``priced``: what a priced mode also reads, as
        :func:`~hf_dspark.scheduling.policy.priced_tree_count` takes it (draft seconds, rows, generating rows,
        lookahead, premium)."""
        return len(values), True


MODES: dict[str, VerifyMode] = {}


def register(cls: type[VerifyMode]) -> type[VerifyMode]:
    """Register a mode class under its ``name`` (``ValueError`` if the name is taken); used as a decorator."""
    if cls.name in MODES or cls.name == "auto":
        raise ValueError(f"a verify mode named {cls.name!r} is already registered")
    MODES[cls.name] = cls()
    return cls
