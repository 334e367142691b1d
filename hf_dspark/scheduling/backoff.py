"""Back-off: rounds that sit out after rounds that did not pay, doubling while they keep not paying.

The chain and tree schedules back off from drafting (a drafted round worth less than a plain step), and trees
also narrow to their chain (a tree worth less than its chain); each is one :class:`Backoff`.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_BACKOFF = 16  # the most rounds in a row that sit out before the choice is tried again


@dataclass
class Backoff:
    """``length``: the current back-off (0: none), doubled from 1 up to ``MAX_BACKOFF`` by each round judged not
    to pay, reset by one that pays; ``left``: the rounds still to sit out."""

    length: int = 0
    left: int = 0

    def judge(self, pays: bool) -> None:
        """A round was judged: reset, or sit out the next ``length`` rounds (doubled)."""
        self.length = 0 if pays else min(2 * self.length or 1, MAX_BACKOFF)
        self.left = self.length

    def sit_out(self) -> bool:
        """Whether this round sits out; it counts as one of the rounds left."""
        out = self.left > 0
        self.left = max(self.left - 1, 0)
        return out
