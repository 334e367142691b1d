"""``threshold``: each row verifies its prefix of confidences c_k ≥ ``confidence_threshold`` (a tree, its leading
ranked nodes valued at least that); the plan closes at the first column no row passes, so drafting stops there."""

from __future__ import annotations

from ..policy import ColumnPlan
from .base import VerifyMode, register


@register
class Threshold(VerifyMode):
    name = "threshold"

    def column_plan(self, caps, sps, threshold, recalibration=None, lookahead=False, layout="padded") -> ColumnPlan:
        return ColumnPlan(caps, threshold=threshold)

    def tree_count(self, values, sps, threshold, *priced) -> tuple[int, bool]:
        return next((i for i, v in enumerate(values) if v < threshold), len(values)), True
