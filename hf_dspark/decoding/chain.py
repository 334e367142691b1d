"""Chain rounds: each row verifies one drafted block (or, alone in the batch, a lookup continuation).

ChainRounds.plan     what each row may verify this round: lookups, length caps, back-off, the column planner
draft_block          (drafting.py) the drafted block, ended where the plan closes
ChainRounds.lengths  the verify lengths from the block's confidences; back-off for the rounds that follow
row_proposals        what each row verifies: its drafted block cut to its length, or its lookup continuation
chain_round          one round: the above in order, then every row's chain (a tree of width one) through the one
                     verify (verification.py): one forward, exact walks, both caches keep the accepted paths

What carries over between rounds (prices, back-off, recalibration, the observed costs) is the call's
:class:`~hf_dspark.scheduling.chains.ChainSchedule`, pure and apart; this module drafts, looks up and verifies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..scheduling.chains import ChainSchedule
from ..scheduling.policy import ColumnPlan, width_buckets
from ..scheduling.recalibration import AcceptanceRecalibration
from ..settings import MAX_VERIFY_WIDTH, DecodingConfig
from .costs import PricedRounds, observed_rounds, round_prices
from .drafting import Proposal, draft_block
from .lookup import LookupProposer, one_hot_probs
from .state import Call, DecodeState
from .tree import VerifiedTree
from .verification import verify


@dataclass
class RoundPlan:
    """What each row may verify this round: ``caps`` [R] bound its draft tokens (0: finished, backing off, or
    looked up), ``looked_up`` maps rows to the lookup continuation they verify instead, and ``planner`` (when the
    mode plans column by column) closes the verify lengths as the draft's slots come."""

    caps: list[int]
    looked_up: dict[int, torch.Tensor]
    planner: ColumnPlan | None

    @property
    def max_tokens(self) -> int:
        return max(self.caps)


@dataclass
class RowProposal:
    """What one row verifies this round: ``tokens`` [ℓ], their proposal distribution ``probs`` [ℓ, V] (sampling
    only; one-hot for a lookup continuation) and the draft's ``confidences`` (ℓ floats) for a drafted block, None for
    a lookup continuation, which neither the recalibration nor the stats count as drafted."""

    tokens: torch.Tensor
    probs: torch.Tensor | None
    confidences: list[float] | None
    looked_up: bool = False


def row_proposals(
    plan: RoundPlan, proposal: Proposal, lengths: list[int], vocab_size: int, do_sample: bool
) -> list[RowProposal]:
    """Each row's proposal for this round (``lengths`` [R]: tokens it verifies): the one place where drafted blocks
    and lookup continuations meet; verification, acceptance and the schedule read only the result."""
    confidences = proposal.confidences.tolist() if proposal.confidences is not None else None  # one transfer
    rows = []
    for r, ell in enumerate(lengths):
        found = plan.looked_up.get(r)
        if found is not None:  # a deterministic proposal: q is one-hot (greedy needs no q)
            rows.append(RowProposal(found, one_hot_probs(found, vocab_size) if do_sample else None, None, True))
            continue
        q = proposal.probs[r, :ell] if proposal.probs is not None else None
        rows.append(RowProposal(proposal.tokens[r, :ell], q, None if confidences is None else confidences[r][:ell]))
    return rows


@dataclass
class ChainRounds(PricedRounds):
    """A call's chain rounds: what each row may verify (room, ``verify_limit``, lookup continuations), priced and
    chosen by the call's :class:`~hf_dspark.scheduling.chains.ChainSchedule`, which carries the state between
    rounds (back-off, recalibration, observed costs)."""

    settings: DecodingConfig
    draft_tokens: int  # the draft's tokens per block (``num_draft_tokens``)
    schedule: ChainSchedule = field(init=False)  # made from the settings
    lookup: LookupProposer | None = field(init=False)  # the call's lookup drafting (``lookup_max_ngram`` > 0)
    drafted_limit: int = field(init=False)  # the most draft tokens a row verifies: γ within ``verify_limit``

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
        self.schedule = ChainSchedule(s.verify_mode, s.verify_layout, s.confidence_threshold, s.greedy_lookahead,
                                      recalibration, buckets)  # fmt: skip

    def price(self, call: Call, rows: int, measured_rows: int | None = None) -> None:
        """Price verifies of ``rows`` batch rows (with the profile measured for ``measured_rows``, default
        ``rows``); with measured costs (no ``draft.sps_profile``) and ``cost_recalibration``, also time the call's
        rounds against those prices (:class:`~hf_dspark.scheduling.observed.ObservedRounds`): a drafted round must
        then beat a plain step by the premium they show."""
        if self.priced:
            sps, drafting = round_prices(call.draft, call.target, measured_rows or rows, call.rules.do_sample)
            self.schedule.set_prices(sps, drafting, rows)
            self.schedule.observed = observed_rounds(self.observed, call.draft, self.settings.cost_recalibration)

    def plan(self, state: DecodeState, max_length: int) -> RoundPlan:
        # a row whose recent tokens repeat earlier ones verifies what followed them instead of a drafted block, when
        # it is the only row running: in a batch every row shares the verify block's width, and lookups, which no
        # plan prices, widened it past what the scheduler pays for (R = 4: 58 tok/s against 67 scheduled)
        alone = self.lookup is not None and len(state.active) == 1
        looked_up = self.lookups(state, max_length) if alone else {}
        caps = self.schedule.caps(state.room(self.drafted_limit, max_length), looked_up)
        return RoundPlan(caps, looked_up, self.schedule.planner(caps))

    def lookups(self, state: DecodeState, max_length: int) -> dict[int, torch.Tensor]:
        """{row: the lookup continuation it verifies this round} for the rows whose last n-gram occurred earlier:
        at most the lookup's width, within ``verify_limit`` and the room left before ``max_length``."""
        limit = self.lookup.width
        if self.settings.verify_limit is not None:
            limit = min(limit, self.settings.verify_limit)
        room, found = state.room(limit, max_length), {}
        for r in state.active:
            tokens = self.lookup.continuation(state.history(r), room[r])
            if tokens.numel():
                found[r] = tokens
        return found

    def lengths(self, plan: RoundPlan, proposal: Proposal, state: DecodeState) -> list[int]:
        """Tokens each row verifies (:meth:`ChainSchedule.lengths`): a looked-up row its whole continuation."""
        looked_up = {r: tokens.shape[0] for r, tokens in plan.looked_up.items()}
        return self.schedule.lengths(plan.caps, plan.planner, proposal.confidences, state.active, looked_up)

    def observe(self, rows: list[RowProposal], accepted: list[int]) -> None:
        """After a verify (``accepted`` [R]: each row's accepted candidates): each drafted row's acceptance feeds
        the recalibration, a looked-up row's the lookup's rate and width."""
        self.schedule.observe([row.confidences for row in rows], accepted)
        for r, row in enumerate(rows):
            if row.looked_up:
                ell = row.tokens.shape[0]
                self.lookup.observe(min(accepted[r] + 1, ell), accepted[r])
                self.lookup.observe_width(ell, accepted[r])

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` [R'] of the schedule's remembered confidences (after :meth:`DecodeState.compact`)."""
        self.schedule.keep_rows(index)

    def round(self, call: Call, state: DecodeState) -> None:
        chain_round(call, self, state)


def chain_round(call: Call, rounds: ChainRounds, state: DecodeState) -> None:
    """One chain round: plan, draft, choose lengths, then each active row's chain through the one verify
    (:func:`~hf_dspark.decoding.verification.verify`: one forward, exact walks, both caches keep the paths)."""
    start, rules, stats, active = time.perf_counter(), call.rules, call.outputs.stats, state.active
    plan = rounds.plan(state, call.max_length)
    proposal = draft_block(
        call.draft, *state.draft_inputs(), plan.max_tokens, rules.processors, rules.do_sample, plan.planner
    )
    lengths = rounds.lengths(plan, proposal, state)
    stats.verify_rounds.append([lengths[r] for r in active])
    rows = row_proposals(plan, proposal, lengths, call.vocab_size, rules.do_sample)
    chains = [VerifiedTree.chain(row.tokens, row.probs) if r in active else None for r, row in enumerate(rows)]
    walks = verify(call, state, chains, rounds.buckets)
    accepted = [0 if walk is None else len(walk.slots) for walk in walks]
    for r in active:
        row = rows[r]
        stats.record(row.tokens.shape[0], accepted[r], walks[r].committed, row.confidences, looked_up=row.looked_up)
    rounds.observe(rows, accepted)
    if state.active:
        rounds.time_round(time.perf_counter() - start)  # acceptance read the logits on the host: it is done
