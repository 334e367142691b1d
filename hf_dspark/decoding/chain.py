"""Chain rounds: each row verifies one drafted block (or, alone in the batch, a lookup continuation).

    ChainRounds.requests  what each row may verify this round: its room, whether the round drafts, the column plan
    propose               (proposers.py) the lookup's continuation, then one drafted block for the rows left
    ChainRounds.choose    the verify lengths from the block's confidences; each row's chain (a tree of width one)
    ChainRounds.observe   the stats, the recalibration, the lookup's rate and width

The round itself is the loop's one round (``loop.play_round``), shared with tree rounds: propose, choose, one
verify (verification.py), observe. What carries over between rounds (prices, back-off, recalibration, the observed
costs) is the call's :class:`~hf_dspark.scheduling.chains.ChainSchedule`, pure and apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..scheduling.chains import ChainSchedule
from ..scheduling.policy import width_buckets
from ..scheduling.recalibration import AcceptanceRecalibration
from ..settings import MAX_VERIFY_WIDTH, DecodingConfig
from .costs import PricedRounds, observed_rounds, round_prices
from .drafting import DraftContext
from .lookup import LookupProposer
from .proposers import ChainCandidate, DraftBlockProposer, Proposer, RowRequest
from .state import Call, DecodeState
from .tree import VerifiedTree
from .verify import Walk


@dataclass
class ChainRounds(PricedRounds):
    """A call's chain rounds: what each row may verify (room, ``verify_limit``, lookup continuations), priced and
    chosen by the call's :class:`~hf_dspark.scheduling.chains.ChainSchedule`, which carries the state between
    rounds (back-off, recalibration, observed costs). ``drafter``: the proposer of the drafted block
    (:func:`chain_schedule` gives the draft's; None only for rounds that are priced, never run); the lookup, when
    the settings ask for it, proposes first."""

    settings: DecodingConfig
    draft_tokens: int  # the draft's tokens per block (``num_draft_tokens``)
    drafter: Proposer | None = None
    schedule: ChainSchedule = field(init=False)  # made from the settings
    lookup: LookupProposer | None = field(init=False)  # the call's lookup drafting (``lookup_max_ngram`` > 0)
    drafted_limit: int = field(init=False)  # the most draft tokens a row verifies: γ within ``verify_limit``
    empty = ChainCandidate  # a row's candidates start as an empty chain

    def __post_init__(self):
        s = self.settings
        self.lookup = LookupProposer.of(s, self.draft_tokens)
        self.drafted_limit = min(self.draft_tokens, s.verify_limit if s.verify_limit is not None else self.draft_tokens)
        recalibration = AcceptanceRecalibration(self.draft_tokens) if s.priced and s.confidence_recalibration else None
        buckets = None
        if s.verify_buckets:  # the widest block: a drafted one, or a lookup continuation
            limit = s.verify_limit if s.verify_limit is not None else MAX_VERIFY_WIDTH
            looked_up = min(self.lookup.max_tokens, limit) if self.lookup is not None else 0
            buckets = width_buckets(1 + max(self.drafted_limit, looked_up), 1 + self.drafted_limit)
        self.schedule = ChainSchedule(s.verify_mode, s.confidence_threshold, s.greedy_lookahead, buckets,
                                      layout=s.verify_layout, recalibration=recalibration)  # fmt: skip

    @property
    def proposers(self) -> list[Proposer]:
        return [p for p in (self.lookup, self.drafter) if p is not None]

    def price(self, call: Call, rows: int, measured_rows: int | None = None) -> None:
        """Price verifies of ``rows`` batch rows (with the profile measured for ``measured_rows``, default
        ``rows``); with measured costs (no ``draft.sps_profile``) and ``cost_recalibration``, also time the call's
        rounds against those prices (:class:`~hf_dspark.scheduling.observed.ObservedRounds`): a drafted round must
        then beat a plain step by the premium they show."""
        if self.priced:
            sps, drafting = round_prices(call.draft, call.target, measured_rows or rows, call.rules.do_sample)
            self.schedule.set_prices(sps, drafting, rows)
            self.schedule.observed = observed_rounds(self.observed, call.draft, self.settings.cost_recalibration)

    def requests(self, state: DecodeState, max_length: int, processors, sample: bool = False) -> list[RowRequest]:
        """One request per batch row, finished rows included (their room is 0: the drafted block keeps a row for
        each): room within the drafted limit, whether the round drafts (not backed off), the schedule's column
        plan, and the lookup's depth. A row looks up only when it runs alone: in a batch every row shares the verify
        block's width, and lookups, which no plan prices, widened it past what the scheduler pays for (R = 4: 58
        tok/s against 67 scheduled)."""
        room = state.room(self.drafted_limit, max_length)
        lookup_room = [0] * state.size
        if self.lookup is not None and len(state.active) == 1:
            limit = self.lookup.width
            if self.settings.verify_limit is not None:
                limit = min(limit, self.settings.verify_limit)
            lookup_room = state.room(limit, max_length)
        draft = self.schedule.start_round()
        plan = self.schedule.planner
        return [
            RowRequest(r, state.history(r), state.anchor_positions[r], room[r], self.drafted_limit, processors,
                       draft=draft, sample=sample, lookup_depth=lookup_room[r], plan=plan)
            for r in range(state.size)
        ]  # fmt: skip

    def choose(
        self, call: Call, candidates: list[ChainCandidate], requests: list[RowRequest], state: DecodeState
    ) -> list[VerifiedTree | None]:
        """Each active row's chain: its drafted block cut to the length the schedule chose
        (:meth:`ChainSchedule.lengths`), or the continuation a proposer gave it, whole; None for a finished row."""
        block = candidates[0].block  # the batch's, from the drafted block's one pass (shared by every row)
        # a row with a continuation (a lookup's, or another proposer's) verifies it whole, within the row's room
        whole = {
            request.row: min(len(c), max(request.max_depth, request.lookup_depth or 0))
            for request, c in zip(requests, candidates, strict=True)
            if c.source is not None
        }
        caps = [c.cap for c in candidates]  # a chain round's requests are the batch's rows, in order
        lengths = self.schedule.lengths(caps, block.planner, block.confidences, state.active, whole)
        confidences = block.confidences.tolist() if block.confidences is not None else None  # one transfer
        active, sample = set(state.active), call.rules.do_sample
        verified = []
        for request, c in zip(requests, candidates, strict=True):
            c.settle(request.row, lengths[request.row], confidences, call.vocab_size, sample)
            verified.append(VerifiedTree.chain(c.tokens, c.probs) if request.row in active else None)
        return verified

    def observe(
        self,
        call: Call,
        candidates: list[ChainCandidate],
        requests: list[RowRequest],
        verified: list[VerifiedTree | None],
        walks: list[Walk | None],
    ) -> None:
        """After the verify: each verified row's stats; each drafted row's acceptance feeds the recalibration, a
        looked-up row's the lookup's rate and width (another proposer's continuation feeds neither)."""
        stats = call.outputs.stats
        accepted = [0 if walk is None else len(walk.slots) for walk in walks]
        for request, c in zip(requests, candidates, strict=True):
            r, ell = request.row, len(c)
            if verified[r] is not None:
                stats.record(ell, accepted[r], walks[r].committed, c.confidences, looked_up=c.looked_up)
            if c.looked_up:
                self.lookup.observe(min(accepted[r] + 1, ell), accepted[r])
                self.lookup.observe_width(ell, accepted[r])
        self.schedule.observe([c.confidences for c in candidates], accepted)

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` [R'] of the schedule's remembered confidences (after :meth:`DecodeState.compact`)."""
        self.schedule.keep_rows(index)


def chain_schedule(draft, settings: DecodingConfig, context: DraftContext) -> ChainRounds:
    """The call's :class:`ChainRounds`, its drafted blocks read from the call's draft ``context``."""
    return ChainRounds(settings, draft.config.num_draft_tokens, DraftBlockProposer(draft, context))
