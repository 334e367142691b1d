"""The schedule a call's rounds carry between them, chains and trees alike: what the verify mode prices its rounds
with, when not to draft, and what the rounds really cost against those prices. How a round chooses what each row
verifies is the one thing the routes do their own way (``chains.py``: a length per row; ``trees.py``: ranked nodes
admitted across rows), because a chain's rows verify blocks of their own lengths while a batch's trees share ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .backoff import Backoff
from .modes import PRICED_MODES
from .observed import ObservedRounds, premium
from .policy import SPSProfile


@dataclass
class Schedule:
    """A call's schedule: the verify ``mode`` (with its ``threshold`` and greedy ``lookahead``), the widths verifies
    pad to (``buckets``; each width is priced at its bucket's cost), the target's verify steps per second ``sps``
    over the batch and the seconds one round's drafting costs it (``drafting``), the back-off from drafting (a
    drafted round that was not worth a plain step in expectation turns drafting off for some rounds: doubling, reset
    by a drafted round that pays; those rounds are plain decode steps through the same verify, so the output is
    unchanged) and, with measured costs, the rounds' wall time against their prices (``observed``: a drafted round
    must then beat a plain step by the premium the call's own rounds showed)."""

    mode: str
    threshold: float
    lookahead: bool
    buckets: tuple[int, ...] | None = None
    sps: SPSProfile | None = None  # the target's verify steps per second (priced modes)
    drafting: float = 0.0  # seconds one round's drafting costs the batch
    backoff: Backoff = field(default_factory=Backoff)  # rounds that do not draft after a round that did not pay
    observed: ObservedRounds | None = None  # measured costs: the call's rounds as they ran against their prices

    @property
    def priced(self) -> bool:
        return self.mode in PRICED_MODES

    @property
    def premium(self) -> float:
        """What a drafted round must beat a plain step by (1 before any round, or with a profile the user set)."""
        return premium(self.observed)

    def set_prices(self, sps: SPSProfile, drafting: float, rows: int) -> None:
        """Price verifies of ``rows`` batch rows with ``sps`` (each width at its bucket's cost) and a round's drafting
        at ``drafting`` seconds."""
        self.sps = sps.bucketed(self.buckets, rows)
        self.drafting = drafting

    def start_round(self) -> bool:
        """A round begins: -> whether it drafts (not backed off); a round that does not is a plain decode step, or
        verifies what costs nothing to draft (lookup continuations)."""
        return not self.backoff.sit_out()

    def expect(self, drafted: bool, slots: int, drafting: float) -> None:
        """The round under way verifies ``slots`` slots over the batch (rows × width) after ``drafting`` seconds of
        drafting (0 when it did not draft): its price, against which its wall time is observed."""
        if self.observed is not None:
            self.observed.expect(drafted, 1 / self.sps(slots) + drafting)
