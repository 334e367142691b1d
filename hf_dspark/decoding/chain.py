"""Chain rounds: each row verifies one drafted block (or, alone in the batch, a lookup continuation).

Schedule.plan     what each row may verify this round: lookups, length caps, back-off, the column planner
draft_block       (drafting.py) the drafted block, ended where the plan closes
Schedule.lengths  the verify lengths from the block's confidences; back-off for the rounds that follow
row_proposals     what each row verifies: its drafted block cut to its length, or its lookup continuation
chain_round       one round: the above in order, then every row's chain (a tree of width one) through the one
                  verify (verification.py): one forward, exact walks, both caches keep the accepted paths
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..scheduling.backoff import Backoff
from ..scheduling.modes import choose_lengths, column_plan
from ..scheduling.policy import ColumnPlan, SPSProfile, drafting_pays, width_buckets
from ..scheduling.recalibration import AcceptanceRecalibration
from ..settings import MAX_VERIFY_WIDTH, DecodingConfig
from .costs import ObservedRounds, PricedRounds, observed_rounds, premium, round_prices
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
class Schedule(PricedRounds):
    """How many draft tokens each row verifies, round after round (``settings.verify_mode``), and when not to draft.

    When a drafted round was not worth its cost in expectation (:func:`drafting_pays`: the tokens its plan expected
    per second of drafting + verifying, against a plain step), the next rounds do not draft (``backoff``: doubling,
    reset by a drafted round that pays). Those rounds are plain decode steps through the same
    verify path, so the output is unchanged.
    """

    settings: DecodingConfig
    draft_tokens: int  # the draft's tokens per block (``num_draft_tokens``)
    sps: SPSProfile | None = None  # the target's verify steps per second (priced modes)
    drafting: float = 0.0  # seconds of one draft block
    planning: SPSProfile | None = None  # ``sps`` with the draft block's cost added to every step
    confidences: list[torch.Tensor] = field(default_factory=list)  # the last two drafted rounds' (async: the older)
    backoff: Backoff = field(default_factory=Backoff)  # rounds that do not draft after a round that did not pay
    lookup: LookupProposer | None = None  # the call's lookup drafting (``lookup_max_ngram`` > 0)
    recalibration: AcceptanceRecalibration | None = None  # priced modes: the head's confidences, shifted per call
    observed: ObservedRounds | None = None  # measured costs: the call's rounds as they ran against their prices
    buckets: tuple[int, ...] | None = None  # the widths verifies pad to (``verify_buckets``)

    def __post_init__(self):
        s = self.settings
        self.lookup = LookupProposer.of(s, self.draft_tokens)
        if self.priced and s.confidence_recalibration:
            self.recalibration = AcceptanceRecalibration(self.draft_tokens)
        if s.verify_buckets:  # the widest block: a drafted one, or a lookup continuation
            limit = s.verify_limit if s.verify_limit is not None else MAX_VERIFY_WIDTH
            looked_up = min(self.lookup.max_tokens, limit) if self.lookup is not None else 0
            self.buckets = width_buckets(1 + max(min(self.draft_tokens, limit), looked_up))

    def price(self, call: Call, rows: int, measured_rows: int | None = None) -> None:
        """Price verifies of ``rows`` batch rows (with the profile measured for ``measured_rows``, default
        ``rows``; each width at its bucket's cost with ``buckets``); with measured costs (no ``draft.sps_profile``)
        and ``cost_recalibration``, also time the call's rounds against those prices
        (:class:`~hf_dspark.decoding.costs.ObservedRounds`): a drafted round must then beat a plain step by the
        premium they show."""
        if self.priced:
            sps, self.drafting, _ = round_prices(call.draft, call.target, measured_rows or rows, call.rules.do_sample)
            self.sps = sps.bucketed(self.buckets, rows)
            self.planning = self.sps.plus_seconds(self.drafting)
            self.observed = observed_rounds(self.observed, call.draft, self.settings.cost_recalibration)

    def plan(self, state: DecodeState, max_length: int) -> RoundPlan:
        s = self.settings
        limit = min(self.draft_tokens, s.verify_limit if s.verify_limit is not None else self.draft_tokens)
        room = state.room(limit, max_length)
        # a row whose recent tokens repeat earlier ones verifies what followed them instead of a drafted block, when
        # it is the only row running: in a batch every row shares the verify block's width, and lookups, which no
        # plan prices, widened it past what the scheduler pays for (R = 4: 58 tok/s against 67 scheduled)
        alone = self.lookup is not None and len(state.active) == 1
        looked_up = self.lookups(state, max_length) if alone else {}
        sits_out = self.backoff.sit_out()
        caps = [0 if sits_out or r in looked_up else room[r] for r in range(state.size)]
        planner = column_plan(
            s.verify_mode, s.verify_layout, caps, self.planning, s.confidence_threshold, self.recalibration,
            s.greedy_lookahead,
        )  # fmt: skip
        return RoundPlan(caps, looked_up, planner)

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

    def observe(self, rows: list[RowProposal], accepted: list[int]) -> None:
        """After a verify (``accepted`` [R]: each row's accepted candidates): each drafted row's acceptance feeds
        the recalibration, a looked-up row's the lookup's rate and width."""
        for r, row in enumerate(rows):
            if row.confidences and self.recalibration is not None:
                self.recalibration.observe(row.confidences, accepted[r])
            if row.looked_up:
                ell = row.tokens.shape[0]
                self.lookup.observe(min(accepted[r] + 1, ell), accepted[r])
                self.lookup.observe_width(ell, accepted[r])

    def lengths(self, plan: RoundPlan, proposal: Proposal, state: DecodeState) -> list[int]:
        """Tokens each row verifies: the plan's (closed while drafting, or chosen now from the whole block), a
        looked-up row's whole continuation. Sets the back-off from what the drafted rows' plan expected."""
        s, conf = self.settings, proposal.confidences
        if plan.planner is not None:
            lengths = plan.planner.lengths
        else:
            lengths = choose_lengths(
                s.verify_mode, conf, plan.caps, self.confidences, self.planning, s.confidence_threshold,
                s.verify_layout, self.recalibration,
            )  # fmt: skip
        drafted_round = conf is not None and conf.shape[1] > 0
        if self.observed is not None:
            width = 1 + max([lengths[r] for r in state.active] + [plan.looked_up[r].shape[0] for r in plan.looked_up])
            self.observed.expect(drafted_round, 1 / self.sps(state.size * width) + self.drafting * drafted_round)
        if drafted_round:
            priced = conf if self.recalibration is None else self.recalibration.apply(conf)
            self.confidences = [*self.confidences[-1:], priced.cpu()]
            if self.priced:
                drafted = [r for r in state.active if r not in plan.looked_up]
                expected = [lengths[r] for r in drafted]
                pays = drafting_pays(
                    self.confidences[-1][drafted], expected, state.size, self.sps, self.drafting, premium(self.observed)
                )
                self.backoff.judge(pays)
        for r, found in plan.looked_up.items():
            lengths[r] = found.shape[0]
        return lengths

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` [R'] of the remembered confidences (after :meth:`DecodeState.compact`)."""
        self.confidences = [c[index.cpu()] for c in self.confidences]

    def round(self, call: Call, state: DecodeState) -> None:
        chain_round(call, self, state)


def chain_round(call: Call, schedule: Schedule, state: DecodeState) -> None:
    """One chain round: plan, draft, choose lengths, then each active row's chain through the one verify
    (:func:`~hf_dspark.decoding.verification.verify`: one forward, exact walks, both caches keep the paths)."""
    start, rules, stats, active = time.perf_counter(), call.rules, call.outputs.stats, state.active
    plan = schedule.plan(state, call.max_length)
    proposal = draft_block(
        call.draft, *state.draft_inputs(), plan.max_tokens, rules.processors, rules.do_sample, plan.planner
    )
    lengths = schedule.lengths(plan, proposal, state)
    stats.verify_rounds.append([lengths[r] for r in active])
    rows = row_proposals(plan, proposal, lengths, call.vocab_size, rules.do_sample)
    chains = [VerifiedTree.chain(row.tokens, row.probs) if r in active else None for r, row in enumerate(rows)]
    walks = verify(call, state, chains, schedule.buckets)
    accepted = [0 if walk is None else len(walk.slots) for walk in walks]
    for r in active:
        row = rows[r]
        stats.record(row.tokens.shape[0], accepted[r], walks[r].committed, row.confidences, looked_up=row.looked_up)
    schedule.observe(rows, accepted)
    if state.active:
        schedule.time_round(time.perf_counter() - start)  # acceptance read the logits on the host: it is done
