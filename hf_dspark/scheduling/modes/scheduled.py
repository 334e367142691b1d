"""``scheduled``: Algorithm 1 with the target's SPS profile and the draft's cost (docs/method.md, "Prefix
scheduler"). On the padded layout (or one row) whole columns are admitted as the draft produces them, and the plan
closes at the first that does not raise Θ; the packed multi-row layout plans tokens from the whole block; a tree
admits ranked nodes while Θ rises."""

from __future__ import annotations

from ..policy import ColumnPlan, capped_confidences, plan_verify_lengths, priced_tree_count
from .base import VerifyMode, register


@register
class Scheduled(VerifyMode):
    name = "scheduled"
    priced = True

    def column_plan(self, caps, sps, threshold, recalibration=None, lookahead=False, layout="padded"):
        if layout == "padded" or len(caps) == 1:
            return ColumnPlan(caps, sps=sps, recalibration=recalibration, lookahead=lookahead)
        return None  # packed, several rows: a later column's token may sort before an earlier row's

    def block_lengths(self, confidences, caps, history, sps, layout, recalibration) -> list[int]:
        return plan_verify_lengths(capped_confidences(confidences, caps, recalibration), sps)

    def tree_count(self, values, sps, threshold, *priced) -> tuple[int, bool]:
        return priced_tree_count(values, sps, *priced)
