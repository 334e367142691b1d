"""The chain schedule: how many draft tokens each row verifies, round after round, and when not to draft.

It is the call's :class:`~hf_dspark.scheduling.schedule.Schedule` (prices, back-off, observed costs) with what chain
rounds add (the rounds are ``hf_dspark.decoding.chain``): the last rounds' confidences (the asynchronous mode sizes a
round from the one two rounds back), the per-call recalibration and the column planner. Like the rest of this package it
reads numbers only: the round hands it each row's cap, the draft's confidences and what the rows accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .modes import choose_lengths, column_plan
from .policy import ColumnPlan, SPSProfile, drafting_pays
from .recalibration import AcceptanceRecalibration
from .schedule import Schedule


@dataclass
class ChainSchedule(Schedule):
    """How many draft tokens each row verifies (verify ``mode`` with its ``layout``, ``threshold`` and greedy
    ``lookahead``), and when not to draft: when a drafted round was not worth its cost in expectation
    (:func:`drafting_pays`: the tokens its plan expected per second of drafting + verifying, against a plain step
    by the call's observed premium), the next rounds do not draft (the :class:`Schedule`'s back-off). ``drafting``
    is one draft block's seconds."""

    layout: str = "padded"
    recalibration: AcceptanceRecalibration | None = None  # priced modes: the head's confidences, shifted per call
    planning: SPSProfile | None = None  # ``sps`` with the draft block's cost added to every step
    confidences: list[torch.Tensor] = field(default_factory=list)  # the last two drafted rounds' (async: the older)

    def set_prices(self, sps: SPSProfile, drafting: float, rows: int) -> None:
        """:meth:`Schedule.set_prices`, and the planners' profile: each step with a draft block's cost added."""
        super().set_prices(sps, drafting, rows)
        self.planning = self.sps.plus_seconds(drafting)

    def planner(self, caps: list[int]) -> ColumnPlan | None:
        """The mode's column plan for rows capped at ``caps`` (drafting may stop where it closes), or ``None`` when
        it chooses from the whole block."""
        return column_plan(
            self.mode, self.layout, caps, self.planning, self.threshold, self.recalibration, self.lookahead
        )

    def lengths(
        self,
        caps: list[int],
        planner: ColumnPlan | None,
        confidences: torch.Tensor | None,
        active: list[int],
        continuations: dict[int, int],
    ) -> list[int]:
        """Tokens each of the R rows verifies: the ``planner``'s (closed while drafting), or chosen now from the
        draft's ``confidences`` [R, ℓ] (None, or ℓ = 0: a round that did not draft) within ``caps`` [R]; a row in
        ``continuations`` ({row: length}: a lookup's, or another proposer's) its whole continuation. Records the
        round's price and sets the back-off from what the drafted ``active`` rows' plan expected."""
        rows = len(caps)
        if planner is not None:
            lengths = planner.lengths
        else:
            lengths = choose_lengths(self.mode, confidences, caps, self.confidences, self.planning, self.threshold,
                                     self.layout, self.recalibration)  # fmt: skip
        drafted_round = confidences is not None and confidences.shape[1] > 0
        if self.observed is not None:
            width = 1 + max([lengths[r] for r in active] + list(continuations.values()))
            self.expect(drafted_round, rows * width, self.drafting if drafted_round else 0.0)
        if drafted_round:
            shifted = confidences if self.recalibration is None else self.recalibration.apply(confidences)
            self.confidences = [*self.confidences[-1:], shifted.cpu()]
            if self.priced:
                drafted = [r for r in active if r not in continuations]
                pays = drafting_pays(self.confidences[-1][drafted], [lengths[r] for r in drafted], rows, self.sps,
                                     self.drafting, self.premium)  # fmt: skip
                self.backoff.judge(pays)
        for r, length in continuations.items():
            lengths[r] = length
        return lengths

    def observe(self, confidences: list[list[float] | None], accepted: list[int]) -> None:
        """After a verify: each drafted row's ``confidences`` (None for a looked-up or finished row) against the
        candidates it ``accepted`` feed the recalibration."""
        if self.recalibration is not None:
            for row, n in zip(confidences, accepted, strict=True):
                if row:
                    self.recalibration.observe(row, n)

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` [R'] of the remembered confidences (after the batch shrank)."""
        self.confidences = [c[index.cpu()] for c in self.confidences]
