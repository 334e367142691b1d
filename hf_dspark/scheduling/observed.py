"""What a call's rounds really cost against what the schedule priced them at, and the premium a drafted round must
pay for it (``cost_recalibration``); the schedules feed it each round's price and wall time."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ObservedRounds:
    """A call's rounds as they really ran against what the scheduler priced them at: the mean ratio of observed to
    priced seconds, for drafted rounds (verify + drafting) and for plain ones, each shrunk toward 1 by ``prior``
    rounds. A measured profile is timed on a fixed shape (random tokens after a 256-token cache, the loop's
    bookkeeping left out), and the calls it prices differ: on this 2-core CPU a 16-row batch after 400-token prompts
    verified 5-8 tokens a row at 2.1x a plain step's time where its profile said 1.65x, so rounds the schedule
    expected to pay lost. :meth:`premium` is how much more a drafted round costs, relative to its price, than a
    plain one: the schedule asks a drafted round to beat a plain step by that factor."""

    prior: float = 2.0
    ratios: dict[bool, list[float]] = field(default_factory=lambda: {True: [], False: []})
    pending: tuple[bool, float] | None = None  # the round under way: (drafted, the seconds it was priced at)

    def expect(self, drafted: bool, priced: float) -> None:
        """The round under way was priced at ``priced`` seconds (``drafted``: verify + drafting)."""
        self.pending = (drafted, priced)

    def finish(self, seconds: float) -> None:
        """The round under way ran in ``seconds``."""
        if self.pending is not None:
            self.observe(*self.pending, seconds)
        self.pending = None

    def observe(self, drafted: bool, priced: float, seconds: float) -> None:
        if priced > 0 and seconds > 0:
            self.ratios[drafted].append(seconds / priced)

    def ratio(self, drafted: bool) -> float:
        seen = self.ratios[drafted]
        return (self.prior + sum(seen)) / (self.prior + len(seen))

    def premium(self) -> float:
        return self.ratio(True) / self.ratio(False)


def premium(observed: ObservedRounds | None) -> float:
    """What a drafted round must beat a plain step by: the call's observed premium, 1 when it observes none."""
    return observed.premium() if observed is not None else 1.0
