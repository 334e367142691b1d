"""``async``: the capacity comes from confidences two rounds old (a global search, safe because they predate the
tokens verified now) and the current block's candidates fill it by current survival; the first rounds, which have
no old confidences, plan as ``scheduled`` does. Trees admit ranked nodes as ``scheduled`` does."""

from __future__ import annotations

from ..policy import (
    capped_confidences,
    fill_top_k,
    plan_capacity,
    plan_capacity_width,
    plan_verify_lengths,
    plan_verify_width,
    priced_tree_count,
)
from .base import VerifyMode, register


@register
class Async(VerifyMode):
    name = "async"
    priced = True

    def block_lengths(self, confidences, caps, history, sps, layout, recalibration) -> list[int]:
        conf = capped_confidences(confidences, caps, recalibration)
        old = history[-2] if len(history) >= 2 and history[-2].shape == conf.shape else None
        if layout == "padded":
            width = plan_capacity_width(old, sps) if old is not None else plan_verify_width(conf, sps)
            return [min(width, cap) for cap in caps]
        return plan_verify_lengths(conf, sps) if old is None else fill_top_k(conf, plan_capacity(old, sps))

    def tree_count(self, values, sps, threshold, *priced) -> tuple[int, bool]:
        return priced_tree_count(values, sps, *priced)
