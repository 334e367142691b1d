"""The DSpark decoding loop, gpt-fast style: one function per idea, and a loop that fits on a screen.

    prefill          the prompt through the target -> the decode state (first token, both caches)
    Schedule.plan    what each row may verify this round: lookups, length caps, back-off, the column planner
    draft_block      (drafting.py) the drafted block, ended where the plan closes
    Schedule.lengths the verify lengths from the block's confidences; back-off for the rounds that follow
    row_proposals    what each row verifies: its drafted block cut to its length, or its lookup continuation
    verify_block     each active row's anchor + proposal as one [R, W] block for one target forward
    accept           exact acceptance per row (verify.py), committed token by token against the stopping criteria
    DecodeState      the batch between rounds: output buffer, caches, draft context; advance, compact

Invariant between rounds: the target's KV cache holds every committed token of each row except its last one (the
row's *anchor*); the draft's context cache holds the projected keys/values of the same slots. Rows of a batch
accept different numbers of tokens, so the caches keep one column per verified slot and an attention mask marks
the slots that hold committed tokens (rejected drafts and padding are holes). Columns that are holes in every row
at the end of a round are cropped, so a single row never carries holes. docs/design.md explains each choice.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from transformers.generation import GenerateDecoderOnlyOutput, GenerationConfig, LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from ..integration.versions import CACHE_FIELD, cache_argument, cache_from, takes_logits_to_keep
from ..model.modeling_dspark import DSparkDraftModel
from ..scheduling.costs import (
    ObservedRounds,
    observed_rounds,
    premium,
    profile_rows,
    round_prices,
    sps_profile,
    tree_draft_seconds,
)
from ..scheduling.policy import (
    ColumnPlan,
    SPSProfile,
    choose_lengths,
    choose_tree_nodes,
    column_plan,
    drafting_pays,
    lookahead_tree_settled,
    tree_rate,
)
from ..scheduling.recalibration import AcceptanceRecalibration
from .checks import (
    check_cache,
    check_finite,
    check_settings_fit,
    check_supported,
    keep_cache_slots,
    sliding_window,
    tree_refusal,
)
from .config import MAX_VERIFY_WIDTH, DecodingConfig
from .drafting import DraftContext, LayerTap, Proposal, draft_block
from .lm_head import verify_head
from .lookup import lookups, one_hot_probs
from .proposers import LookupProposer, TreeRequest, propose_trees, tree_proposers
from .stats import DSparkStats
from .tree import TokenTree, VerifiedTree, tree_attention_mask, walk
from .verify import probs, process, verify_row

MAX_BACKOFF = 16  # most plain rounds in a row before the draft is asked again (scheduled/async modes)


@dataclass
class DSparkGenerateOutput(GenerateDecoderOnlyOutput):
    """``generate``'s output with ``return_dict_in_generate=True``, plus this call's own per-round statistics
    (``draft.stats`` is whichever call on the draft finished last, which differs when threads share a draft)."""

    dspark_stats: DSparkStats | None = None


def target_forward(target, ids, positions, attention_mask, cache, tap: LayerTap, last_logits_only: bool = False):
    """One target forward that extends ``cache``; returns (the model output, the draft's fused context [R, n, d]).
    ``last_logits_only`` (the prefill) asks the model for the last position's logits alone: the prompt's other
    positions need only hidden states, and their LM head would cost more than the rest of a long batched prefill on
    a CPU."""
    extra = {"logits_to_keep": 1} if last_logits_only and takes_logits_to_keep(type(target)) else {}
    extra[cache_argument(type(target))] = cache
    tap.expect(ids.shape[0], ids.shape[1], ids.device)
    with verify_head(target):
        out = target(
            input_ids=ids,
            position_ids=positions,
            attention_mask=attention_mask,
            use_cache=True,
            output_hidden_states=not tap.active,
            **extra,
        )
    return out, tap.fused(out)


@dataclass(frozen=True)
class Rules:
    """How one call chooses tokens and when a row stops, as ``generate`` prepared them: the target's logits
    processors, greedy or sampling, the stopping criteria."""

    processors: LogitsProcessorList
    do_sample: bool
    stopping: StoppingCriteriaList


@dataclass
class DecodeState:
    """The batch between rounds.

    ``tokens`` [R, max_length] holds each row's committed tokens (its left-padded prompt, then new tokens) in its
    first ``lengths[r]`` columns, pad after them; the last committed token is the row's anchor, at position
    ``anchor_positions[r]`` and not yet in the target's cache. ``cache_mask`` [R, S] marks the cache slots that hold
    committed tokens; ``context`` is the draft's cache of the same slots. ``rows[r]`` is row r's index in the
    caller's batch; rows that :meth:`compact` removed wait in ``done``.
    """

    tokens: torch.Tensor
    lengths: list[int]
    finished: list[bool]
    cache: Any
    cache_mask: torch.Tensor
    context: DraftContext
    anchor_positions: torch.Tensor
    rows: list[int]
    done: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.lengths)

    @property
    def active(self) -> list[int]:
        return [r for r, finished in enumerate(self.finished) if not finished]

    def history(self, r: int) -> torch.Tensor:
        """Row r's committed tokens [lengths[r]]: a view of the buffer."""
        return self.tokens[r, : self.lengths[r]]

    def room(self, limit: int, max_length: int) -> list[int]:
        """Per row, the most tokens it may verify this round: ``limit``, within what ``max_length`` leaves after
        the bonus token (0 for a finished row)."""
        return [0 if self.finished[r] else min(limit, max_length - self.lengths[r] - 1) for r in range(self.size)]

    def histories(self) -> list[torch.Tensor]:
        return [self.history(r) for r in range(self.size)]

    def draft_inputs(self) -> tuple[DraftContext, list[torch.Tensor], torch.Tensor]:
        """What :func:`draft_block` drafts from: the draft's context, each row's history, the anchors' positions."""
        return self.context, self.histories(), self.anchor_positions

    def attention_mask(self, block_valid: torch.Tensor) -> torch.Tensor | None:
        """The target's mask for a verify block: [R, S + W] over the cache and the block (``None``: no holes)."""
        mask = torch.cat([self.cache_mask, block_valid.long()], dim=1)
        return None if bool(mask.all()) else mask

    def commit(self, r: int, new: torch.Tensor, scores: torch.Tensor, stopping_criteria) -> int:
        """Append ``new`` [k] to row r and stop where the stopping criteria (shown each token's processed scores,
        [k, V], one token at a time) stop, exactly where plain ``generate`` would: -> how many were committed.
        Columns past the row's length may hold tokens that were not committed; only ``lengths`` counts."""
        start, k = self.lengths[r], min(new.shape[0], self.tokens.shape[1] - self.lengths[r])
        self.tokens[r, start : start + k] = new[:k]
        for i in range(k):
            self.lengths[r] = start + i + 1
            if bool(stopping_criteria(self.tokens[r : r + 1, : start + i + 1], scores[i : i + 1]).any()):
                self.finished[r] = True
                return i + 1
        if self.lengths[r] == self.tokens.shape[1]:
            self.finished[r] = True
        return k

    def advance(self, kept: torch.Tensor, fused: torch.Tensor, positions: torch.Tensor) -> None:
        """After a verify of [R, W] slots: keep in both caches the slots that committed tokens (``kept`` [R, W]: each
        row's anchor + accepted drafts) and crop the columns that are holes in every row."""
        used = int(kept.any(0).nonzero().max()) + 1
        self.cache.crop(-(kept.shape[1] - used))
        self.cache_mask = torch.cat([self.cache_mask, kept[:, :used].long()], dim=1)
        self.context.extend(fused[:, :used], positions[:, :used], kept[:, :used])

    def keep_paths(self, paths: list[list[int]], fused: torch.Tensor, positions: torch.Tensor) -> None:
        """After a tree verify of [R, W] slots: keep in both caches only each row's ``paths[r]`` (its anchor and
        accepted path, in order; empty for a row that keeps nothing), padded to the longest path with holes, so a
        single row never carries holes and no row keeps a rejected branch."""
        used, device = max(len(path) for path in paths), self.tokens.device
        index = torch.tensor([path + [0] * (used - len(path)) for path in paths], device=device)  # one transfer
        kept = torch.tensor([[True] * len(path) + [False] * (used - len(path)) for path in paths], device=device)
        if all(path == list(range(len(path))) for path in paths):  # every path is its slots' prefix: crop, no copy
            self.cache.crop(-(positions.shape[1] - used))  # a padded row's extra slots become holes (kept False)
        else:
            keep_cache_slots(self.cache, self.cache_mask.shape[1], index)
        self.cache_mask = torch.cat([self.cache_mask, kept.long()], dim=1)
        fused = fused.gather(1, index[..., None].expand(-1, -1, fused.shape[-1]))
        self.context.extend(fused, positions.gather(1, index), kept)

    def compact(self) -> torch.Tensor:
        """Drop the finished rows from the batch and both caches (they stop costing verify and draft work):
        -> the indices [R'] of the rows kept."""
        self.done.update({self.rows[r]: self.history(r).clone() for r in range(self.size) if self.finished[r]})
        keep = self.active
        index = torch.tensor(keep, device=self.tokens.device)
        self.cache.batch_select_indices(index)
        self.context.select(index)
        self.tokens, self.cache_mask = self.tokens[index], self.cache_mask[index]
        self.anchor_positions = self.anchor_positions[index]
        self.lengths, self.rows = [self.lengths[r] for r in keep], [self.rows[r] for r in keep]
        self.finished = [False] * len(keep)
        return index

    def sequences(self, batch: int, pad_id: int) -> torch.Tensor:
        """Every row of the caller's batch, in its order: [batch, longest], pad after each row's end."""
        rows = {**self.done, **{self.rows[r]: self.history(r) for r in range(self.size)}}
        width = max(len(h) for h in rows.values())
        out = torch.full((batch, width), pad_id, dtype=torch.long, device=self.tokens.device)
        for r, history in rows.items():
            out[r, : len(history)] = history
        return out


@dataclass
class Outputs:
    """What the call hands back besides the sequences: per-token scores and raw logits (when asked: batch size 1),
    the streamer, and the per-round statistics."""

    stats: DSparkStats
    want_scores: bool = False
    want_logits: bool = False
    streamer: Any = None
    scores: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def wanted(self) -> bool:
        return self.want_scores or self.want_logits or self.streamer is not None

    def emit(self, tokens: torch.Tensor, scores: torch.Tensor, raw: torch.Tensor) -> None:
        """Committed ``tokens`` [k] with their processed ``scores`` and ``raw`` logits [k, V]."""
        if self.want_scores:
            self.scores += list(scores[: len(tokens)].split(1))
        if self.want_logits:
            self.logits += list(raw[: len(tokens)].split(1))
        if self.streamer is not None:
            self.streamer.put(tokens.cpu())


def prefill(
    target,
    draft,
    input_ids,
    model_kwargs: dict,
    cache,
    tap: LayerTap,
    rules: Rules,
    max_length: int,
    pad_id: int,
    outputs: Outputs,
) -> DecodeState:
    """The prompt [R, P] through the target (the last position's logits only) -> the decode state: the target's
    cache and the draft's queued context hold the prompt, and each row holds its first new token as its anchor."""
    R, device = input_ids.shape[0], input_ids.device
    attention_mask = model_kwargs.get("attention_mask")
    cache_mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    positions = (cache_mask.long().cumsum(-1) - 1).clamp_min(0)
    given = model_kwargs.get("position_ids")
    if given is not None and not torch.equal(given[cache_mask.bool()].to(positions), positions[cache_mask.bool()]):
        raise ValueError(
            "DSpark generation counts positions from the attention mask; other position_ids are not supported"
        )
    out, fused = target_forward(target, input_ids, positions, attention_mask, cache, tap, last_logits_only=True)
    if sliding_window(cache) is not None:  # after the prefill, as generate does: keep rejected slots until cropped
        cache.activate_past_recording()
    context = DraftContext.empty(draft, R, input_ids.device)
    context.extend(fused, positions, cache_mask.bool())
    raw = out.logits[:, -1]
    check_finite(raw)
    scores = process(rules.processors, input_ids, raw.float() if raw.dtype != torch.float64 else raw)
    first = torch.multinomial(probs(scores), 1)[:, 0] if rules.do_sample else scores.argmax(-1)
    outputs.emit(first, scores, raw)
    tokens = torch.full((R, max(max_length, input_ids.shape[1] + 1)), pad_id, dtype=torch.long, device=device)
    tokens[:, : input_ids.shape[1]] = input_ids
    state = DecodeState(
        tokens, [input_ids.shape[1]] * R, [False] * R, cache, cache_mask, context, positions[:, -1] + 1, list(range(R))
    )
    for r in range(R):
        state.commit(r, first[r : r + 1], scores[r : r + 1], rules.stopping)
    return state


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


class PricedRounds:
    """What the chain and tree schedules share: whether the call's mode prices its rounds, and each round's wall time
    against its price (``observed``: :class:`~hf_dspark.scheduling.costs.ObservedRounds`, with measured costs)."""

    settings: DecodingConfig
    observed: ObservedRounds | None

    @property
    def priced(self) -> bool:
        return self.settings.priced

    def time_round(self, seconds: float) -> None:
        """A round just ran in ``seconds``: what it cost against its price (the premium a drafted round must pay)."""
        if self.observed is not None:
            self.observed.finish(seconds)


@dataclass
class Schedule(PricedRounds):
    """How many draft tokens each row verifies, round after round (``settings.verify_mode``), and when not to draft.

    When a drafted round was not worth its cost in expectation (:func:`drafting_pays`: the tokens its plan expected
    per second of drafting + verifying, against a plain step), the next ``backoff`` rounds do not draft (doubling up
    to ``MAX_BACKOFF``, reset by a drafted round that pays). Those rounds are plain decode steps through the same
    verify path, so the output is unchanged.
    """

    settings: DecodingConfig
    draft_tokens: int  # the draft's tokens per block (``num_draft_tokens``)
    sps: SPSProfile | None = None  # the target's verify steps per second (priced modes)
    drafting: float = 0.0  # seconds of one draft block
    planning: SPSProfile | None = None  # ``sps`` with the draft block's cost added to every step
    confidences: list[torch.Tensor] = field(default_factory=list)  # the last two drafted rounds' (async: the older)
    backoff: int = 0
    skip: int = 0  # rounds left that do not draft
    lookup_width: int | None = None  # ``lookup_adaptive``: the most tokens the next lookup verifies (None: γ)
    recalibration: AcceptanceRecalibration | None = None  # priced modes: the head's confidences, shifted per call
    observed: ObservedRounds | None = None  # measured costs: the call's rounds as they ran against their prices

    def __post_init__(self):
        if self.priced and self.settings.confidence_recalibration:
            self.recalibration = AcceptanceRecalibration(self.draft_tokens)

    def price(self, draft, target, rows: int, do_sample: bool) -> None:
        """Price rounds of ``rows`` batch rows; with measured costs (no ``draft.sps_profile``) and
        ``cost_recalibration``, also time the call's rounds against those prices
        (:class:`~hf_dspark.scheduling.costs.ObservedRounds`): a drafted round must then beat a plain step by the
        premium they show."""
        if self.priced:
            self.sps, self.drafting, self.planning = round_prices(draft, target, rows, do_sample)
            self.observed = observed_rounds(self.observed, draft, self.settings.cost_recalibration)

    def plan(self, state: DecodeState, max_length: int) -> RoundPlan:
        s = self.settings
        limit = min(self.draft_tokens, s.verify_limit if s.verify_limit is not None else self.draft_tokens)
        room = state.room(limit, max_length)
        # a row whose recent tokens repeat earlier ones verifies what followed them instead of a drafted block, when
        # it is the only row running: in a batch every row shares the verify block's width, and lookups, which no
        # plan prices, widened it past what the scheduler pays for (R = 4: 58 tok/s against 67 scheduled)
        alone = s.lookup_max_ngram > 0 and len(state.active) == 1
        looked_up = lookups(s, state.histories(), self.lookup_room(state, max_length)) if alone else {}
        caps = [0 if self.skip or r in looked_up else room[r] for r in range(state.size)]
        self.skip = max(self.skip - 1, 0)
        planner = column_plan(
            s.verify_mode, s.verify_layout, caps, self.planning, s.confidence_threshold, self.recalibration,
            s.greedy_lookahead,
        )  # fmt: skip
        return RoundPlan(caps, looked_up, planner)

    def lookup_room(self, state: DecodeState, max_length: int) -> list[int]:
        """The most tokens each row's lookup continuation may verify this round: ``lookup_max_tokens`` (γ when
        ``None``; with ``lookup_adaptive``, the width its past lookups earned), within ``verify_limit`` and the room
        left before ``max_length``."""
        s = self.settings
        limit = s.lookup_max_tokens or self.draft_tokens
        if s.lookup_adaptive:
            limit = min(limit, self.lookup_width or self.draft_tokens)
        if s.verify_limit is not None:
            limit = min(limit, s.verify_limit)
        return state.room(limit, max_length)

    def observe(self, rows: list[RowProposal], kept: torch.Tensor) -> None:
        """After a verify (``kept`` [R, W]: the anchor and accepted slots per row): each drafted row's acceptance
        feeds the recalibration. With ``lookup_adaptive``, a lookup accepted in full makes the next lookup's width
        twice its length (at least γ: a short continuation accepted whole is no reason to verify less than a
        drafted block; at most ``lookup_max_tokens``), one cut short sets it back to γ. Only one row looks up in a
        round, so one width serves the call."""
        if self.recalibration is not None:
            for r, row in enumerate(rows):
                if row.confidences:
                    self.recalibration.observe(row.confidences, int(kept[r].sum()) - 1)
        if not self.settings.lookup_adaptive:
            return
        for r, row in enumerate(rows):
            if row.looked_up:
                ell = row.tokens.shape[0]
                cap = self.settings.lookup_max_tokens or self.draft_tokens
                whole = int(kept[r].sum()) - 1 == ell
                self.lookup_width = max(self.draft_tokens, min(2 * ell, cap)) if whole else None

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
                self.backoff = 0 if pays else min(2 * self.backoff or 1, MAX_BACKOFF)
                self.skip = self.backoff
        for r, found in plan.looked_up.items():
            lengths[r] = found.shape[0]
        return lengths

    def select(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` [R'] of the remembered confidences (after :meth:`DecodeState.compact`)."""
        self.confidences = [c[index.cpu()] for c in self.confidences]


@dataclass
class VerifyBlock:
    """Each active row's anchor + proposal, padded into one block: ``tokens`` [R, W], ``valid`` [R, W] (False for
    padding and finished rows), ``positions`` [R, W]."""

    tokens: torch.Tensor
    valid: torch.Tensor
    positions: torch.Tensor


def verify_block(state: DecodeState, rows: list[RowProposal], pad_id: int) -> VerifyBlock:
    R, device = state.size, state.tokens.device
    width = max(rows[r].tokens.shape[0] + 1 for r in state.active)
    tokens = torch.full((R, width), pad_id, dtype=torch.long, device=device)
    valid = torch.zeros(R, width, dtype=torch.bool, device=device)
    for r in state.active:
        ell = rows[r].tokens.shape[0]
        tokens[r, 0] = state.tokens[r, state.lengths[r] - 1]
        tokens[r, 1 : 1 + ell] = rows[r].tokens
        valid[r, : ell + 1] = True
    positions = state.anchor_positions[:, None] + torch.arange(width, device=device)
    return VerifyBlock(tokens, valid, positions)


def accept(
    state: DecodeState,
    block: VerifyBlock,
    raw: torch.Tensor,
    rows: list[RowProposal],
    rules: Rules,
    outputs: Outputs,
) -> torch.Tensor:
    """Exact acceptance for every active row against the target's raw logits [R, W, V]; commits each row's accepted
    drafts + its correction/bonus token. -> kept [R, W]: the slots that now hold committed tokens."""
    kept = torch.zeros_like(block.valid)
    for r in state.active:
        row = rows[r]
        ell = row.tokens.shape[0]
        n, nxt, scores = verify_row(
            row.tokens, row.probs, raw[r, : ell + 1], state.history(r), rules.processors, rules.do_sample
        )
        new = torch.cat([row.tokens[:n], nxt[None]])
        committed = state.commit(r, new, scores, rules.stopping)
        outputs.stats.record(ell, n, committed, row.confidences, looked_up=row.looked_up)
        if outputs.wanted:
            outputs.emit(new[:committed], scores, raw[r])
        kept[r, : n + 1] = True
        state.anchor_positions[r] += n + 1
    return kept


@dataclass
class TreeSchedule(PricedRounds):
    """Token-tree rounds (``settings.tree_top_k`` > 1), each row its own tree: the proposers, how many nodes a row
    verifies per round (``verify_limit``, ``None``: γ · ``tree_top_k``), and when not to draft.

    ``fixed`` verifies each row's most valuable nodes up to the limit; ``threshold`` those worth at least
    ``confidence_threshold``; ``scheduled``/``async`` run Algorithm 1 over the nodes: admit them in order of value
    (parents first) while Θ(B) = (R + Σ values) · SPS(R · (1 + B)) rises, stop at the first that does not raise it,
    with the trees' drafting cost added to every step. In a batch the unit of admission is a rank: the verify is
    padded to the widest row, so the B-th best node of every row is admitted together (summed values), as chains
    admit columns. A drafted round that was not worth a plain step in expectation turns drafting off for ``backoff``
    rounds (doubling, as for chains); lookup branches, which cost nothing to draft, are still verified then, and the
    round that drafts again probes with the chain at the chain's cost. A drafted round whose chain alone (the
    draft's top children, and the lookup branches) at a chain's drafting cost would have been worth more than the
    tree at a tree's (Θ each, :func:`tree_rate`) narrows the next ``narrow_backoff`` drafted rounds to the chain
    (doubling up to ``MAX_BACKOFF``, reset by a tree round worth more than its chain): under load a batch's trees
    shrink to chains, and so does their drafting cost. With measured costs (no ``draft.sps_profile`` set) and
    ``cost_recalibration``, a drafted round must beat a plain step by the premium the call's own rounds showed
    (:class:`~hf_dspark.scheduling.costs.ObservedRounds`)."""

    settings: DecodingConfig
    draft_tokens: int
    proposers: list
    lookup: LookupProposer | None
    recalibration: AcceptanceRecalibration | None = None  # the draft proposer's, fed here from each walk
    sps: SPSProfile | None = None
    drafting: float = 0.0  # seconds one round's tree drafting costs the batch (one backbone pass, every row's head)
    chain_drafting: float | None = None  # seconds of a round that drafts only the chain (None: never narrow)
    backoff: int = 0
    skip: int = 0
    narrow_backoff: int = 0
    narrow: int = 0  # drafted rounds left that draft the chain instead of the tree
    chain_round: bool = False  # whether this round drafts the chain only (narrowed, or probing after a back-off)
    observed: ObservedRounds | None = None  # measured costs: the call's rounds as they ran against their prices

    @property
    def budget(self) -> int:
        s = self.settings
        return s.verify_limit if s.verify_limit is not None else min(self.draft_tokens * s.tree_top_k, MAX_VERIFY_WIDTH)

    def price(self, draft, target, rows: int) -> None:
        """Price verifies of ``rows`` batch rows up to the node budget, and a round of tree drafting for them (the
        rows share the backbone pass: pricing each row at one row's cost overprices a batch's drafting R-fold, and
        the schedule then backs off from trees a batch would have gained from)."""
        if self.priced:
            self.sps = sps_profile(draft, target, rows, max_width=self.budget + 1)
            self.drafting = tree_draft_seconds(draft, self.settings.tree_top_k, rows)
            self.chain_drafting = tree_draft_seconds(draft, 1, rows)
            self.observed = observed_rounds(self.observed, draft, self.settings.cost_recalibration)

    @property
    def round_drafting(self) -> float:
        """Seconds this round's drafting costs the batch: the chain's when it drafts only the chain, else the tree's."""
        return self.chain_drafting if self.chain_round else self.drafting

    def requests(self, state: DecodeState, max_length: int, processors) -> list[TreeRequest]:
        """One request per generating row."""
        room = state.room(max(self.draft_tokens, self.lookup.max_tokens if self.lookup else 0), max_length)
        draft = not self.skip
        self.skip = max(self.skip - 1, 0)
        # a round after a back-off probes whether drafting pays again: with the chain, at the chain's cost
        self.chain_round = draft and bool(self.narrow or self.backoff) and self.chain_drafting is not None
        top_k = 1 if self.chain_round else None
        # one generating row's choice is its own tree's (a batch's sums every row's, known only once all are drafted);
        # merged lookup nodes join after the draft's, so its expansion cannot know the choice before they do
        early = len(state.active) == 1 and not (self.settings.tree_lookup_merge and self.lookup is not None)
        requests = []
        for r in state.active:
            settled = partial(self.settled, state.size, room[r]) if early else None
            requests.append(TreeRequest(r, state.history(r), state.anchor_positions[r], room[r], self.budget,
                                        processors, draft, top_k, settled))  # fmt: skip
        return requests

    def count(self, values: list[float], rows: int, generating: int, drafted: bool) -> tuple[int, bool]:
        """How many of the leading ranked nodes a round verifies, ``values`` their (summed over rows) values,
        ``drafted`` whether the round's draft pass ran (priced once for the batch), and whether drafting paid
        (:func:`~hf_dspark.scheduling.policy.choose_tree_nodes`, priced when the mode is)."""
        if not self.priced:
            return choose_tree_nodes(self.settings.verify_mode, values, None, self.settings.confidence_threshold)
        return self.count_at(values, rows, generating, self.round_drafting if drafted else 0.0)

    def settled(self, rows: int, max_depth: int, tree: TokenTree, bound: float, depth: int) -> bool:
        """Whether one generating row's choice from the drafted ``tree`` is final while nodes are still to come,
        each worth at most ``bound`` and deeper than ``depth``: the choice must stop at a node (not take them all)
        that ranks before any such node, i.e. worth more than ``bound``, or exactly ``bound`` and no deeper than
        them (ties rank the shallower first). Every node up to and including the one it stopped at keeps its rank
        then, so :meth:`select` takes the same nodes as from the whole tree (the early stop reads no further)."""
        ranked = tree.ranked(max_depth)[: self.budget]
        values = [tree.values[n] for n in ranked]
        count = self.count(values, rows, 1, True)[0]
        if self.priced and self.settings.greedy_lookahead:  # the choice may still grow past a drop: bound it
            # the leading nodes that rank before any node still to come (ranked is by value, ties shallower first)
            later = (
                i
                for i, n in enumerate(ranked)
                if values[i] < bound or (values[i] == bound and tree.depths[n] > depth + 1)
            )
            head = next(later, len(ranked))
            return lookahead_tree_settled(values, count, head, bound, self.budget, self.sps, self.round_drafting, rows)
        if count >= len(values):
            return False
        stop = values[count]
        return stop > bound or (stop == bound and tree.depths[ranked[count]] <= depth + 1)

    def select(self, trees: list[TokenTree], requests: list[TreeRequest], rows: int) -> list[list[int]]:
        """Each request's verified nodes, parents before children, in a verify padded over ``rows`` batch rows."""
        ranked = [tree.ranked(request.max_depth)[: self.budget] for tree, request in zip(trees, requests, strict=True)]
        values = [[tree.values[n] for n in nodes] for tree, nodes in zip(trees, ranked, strict=True)]
        if self.priced:
            summed = _rank_sums(values)
            drafted = any(tree.drafted for tree in trees)
            if len(trees) == 1 and not drafted:
                # one row's lookup continuation alone (or nothing) verifies whole, as the chain route verifies it:
                # lookups come right in bursts, so a depth's acceptance given its parent's outruns the call's per-token
                # rate that values them (6 float32 humaneval prompts: 1.6 of 8 nodes verified, 3.0 accepted whole)
                count, pays = len(ranked[0]), False  # `pays` is read only after a drafted round
            else:
                count, pays = self.count(summed, rows, len(requests), drafted)
            counts = [count] * len(ranked)
            if self.observed is not None:
                drafting = self.round_drafting if drafted else 0.0
                self.observed.expect(drafted, 1 / self.sps(rows * (1 + count)) + drafting)
            if drafted:  # back off when this drafted round is not worth a plain step in expectation
                if self.chain_round:  # nothing to weigh: it drafted no branches
                    self.narrow = max(self.narrow - 1, 0)
                elif self.chain_drafting is not None:
                    pays = self.weigh_chain(trees, ranked, summed, count, rows, len(requests)) or pays
                self.backoff = 0 if pays else min(2 * self.backoff or 1, MAX_BACKOFF)
                self.skip = self.backoff
        else:
            counts = [self.count(v, rows, 1, False)[0] for v in values]
        return [
            sorted(nodes[:count], key=lambda n, tree=tree: (tree.depths[n], n))
            for tree, nodes, count in zip(trees, ranked, counts, strict=True)
        ]

    def weigh_chain(
        self, trees: list[TokenTree], ranked: list[list[int]], summed: list[float], count: int, rows: int,
        generating: int,
    ) -> bool:  # fmt: skip
        """After a drafted tree round verifying ``count`` of the ranked nodes (``summed``: their values summed over
        rows): narrow the next rounds to the chain when the Θ of the chain's own choice (Algorithm 1 over its nodes)
        at the chain's drafting cost beats the tree's at the tree's (see the class). -> whether the chain would have
        been worth a plain step."""
        values = []
        for tree, nodes in zip(trees, ranked, strict=True):
            chain = _chain_nodes(tree)
            values.append([tree.values[n] for n in nodes if n in chain])
        chain_summed = _rank_sums(values)
        chain_count, chain_pays = self.count_at(chain_summed, rows, generating, self.chain_drafting)
        tree_theta = tree_rate(summed, count, self.sps, self.drafting, rows, generating)
        chain_theta = tree_rate(chain_summed, chain_count, self.sps, self.chain_drafting, rows, generating)
        if chain_theta > tree_theta:
            self.narrow_backoff = min(2 * self.narrow_backoff or 1, MAX_BACKOFF)
            self.narrow = self.narrow_backoff
        else:
            self.narrow_backoff = 0
        return chain_pays

    def count_at(self, values: list[float], rows: int, generating: int, drafting: float) -> tuple[int, bool]:
        """:meth:`count` for a priced round drafted at ``drafting`` seconds; whether it pays is judged against a
        plain step by the premium the call's rounds showed (1 before any, or with a profile the user set)."""
        s = self.settings
        return choose_tree_nodes(
            s.verify_mode, values, self.sps, s.confidence_threshold, drafting, rows, generating, s.greedy_lookahead,
            premium(self.observed),
        )  # fmt: skip

    def observe(self, verified: VerifiedTree, path: list[int]) -> list[tuple[float, bool, bool]]:
        """After the walk: the lookup rate learns from the looked-up nodes the walk could have taken. -> the verified
        draft nodes whose parent the walk reached: (edge value, top child, taken), for the stats."""
        tree, on_path = verified.tree, {0, *path}
        edges, reached, accepted = [], 0, 0
        for s, node in enumerate(verified.nodes, start=1):
            if verified.parent_slots[s] not in on_path:
                continue
            if "draft" in tree.sources[node]:
                edges.append((tree.edges[node], tree.top[node], s in on_path))
            if "lookup" in tree.sources[node]:
                reached, accepted = reached + 1, accepted + (s in on_path)
        if self.lookup is not None:
            self.lookup.observe(reached, accepted)
        recalibration = self.recalibration
        if recalibration is not None:  # the draft's top choices along the walk, as a chain of positions 1, 2, ...
            slot_of = {node: s for s, node in enumerate(verified.nodes, start=1)}
            confidences, taken, slot = [], 0, 0
            while True:
                top = [n for n in tree.confidences if n in slot_of and verified.parent_slots[slot_of[n]] == slot]
                if not top or len(confidences) == self.draft_tokens:
                    break
                confidences.append(tree.confidences[top[0]])
                if slot_of[top[0]] not in on_path:
                    break
                taken, slot = taken + 1, slot_of[top[0]]
            recalibration.observe(confidences, taken)
        return edges


def _rank_sums(values: list[list[float]]) -> list[float]:
    """Per rank i, the sum over rows of each row's i-th value (rows with fewer values add nothing): a padded batch
    admits the i-th node of every row together."""
    return [sum(v[i] for v in values if i < len(v)) for i in range(max(map(len, values), default=0))]


def _chain_nodes(tree: TokenTree) -> set[int]:
    """The nodes a narrowed round would have drafted: those whose every node from the anchor is the draft's top
    child or a lookup branch's (parents come before their children in a tree)."""
    chain: set[int] = set()
    for node, parent in enumerate(tree.parents):
        if (tree.top[node] or "lookup" in tree.sources[node]) and (parent < 0 or parent in chain):
            chain.add(node)
    return chain


def tree_verify_mask(state: DecodeState, verified: list[VerifiedTree | None], dtype: torch.dtype):
    """The target's mask for a tree verify: ``None`` (plain causal attention, the cheaper path; on a CPU a 4D mask
    costs about 2 ms a step) when the batch is one row whose tree is a chain (each slot's parent the slot before:
    a plain step, or only top children verified) on a cache without holes, else :func:`tree_attention_mask`."""
    tree = verified[0] if len(verified) == 1 else None
    if tree is not None and tree.is_chain and bool(state.cache_mask.all()):
        return None
    return tree_attention_mask(verified, state.cache_mask, dtype)


def tree_round(state: DecodeState, schedule: TreeSchedule, target, cache, tap, rules: Rules, outputs: Outputs,
               max_length: int, pad_id: int) -> None:  # fmt: skip
    """One round of trees: each generating row proposes its tree, the chosen nodes of every row are verified in one
    forward ([R, W] slots, each row's ancestor mask, depth positions), each row walks its accepted path exactly, and
    both caches keep exactly those paths."""
    start = time.perf_counter()
    requests = schedule.requests(state, max_length, rules.processors)
    outputs.stats.narrowed_rounds += any(request.draft and request.top_k == 1 for request in requests)
    trees = propose_trees(schedule.proposers, requests)
    chosen = schedule.select(trees, requests, state.size)
    verified: list[VerifiedTree | None] = [None] * state.size
    for request, tree, nodes in zip(requests, trees, chosen, strict=True):
        verified[request.row] = VerifiedTree.of(tree, nodes)
    outputs.stats.verify_rounds.append([verified[r].size for r in state.active])
    width, device = 1 + max(v.size for v in verified if v is not None), state.tokens.device
    tokens = torch.full((state.size, width), pad_id, dtype=torch.long, device=device)
    positions = state.anchor_positions[:, None].repeat(1, width)
    for request in requests:
        v, r = verified[request.row], request.row
        tokens[r, : 1 + v.size] = v.tokens(int(request.history[-1]), device)[0]
        positions[r, : 1 + v.size] = v.positions(int(request.anchor_position), device)[0]
    out, fused = target_forward(target, tokens, positions, tree_verify_mask(state, verified, target.dtype), cache, tap)
    raw = out.logits.float() if out.logits.dtype != torch.float64 else out.logits
    paths: list[list[int]] = [[] for _ in range(state.size)]
    for request in requests:
        r, v = request.row, verified[request.row]
        check_finite(raw[r, : 1 + v.size])
        result = walk(v, raw[r, : 1 + v.size], request.history, rules.processors, rules.do_sample)
        n = len(result.slots)
        new = torch.cat([tokens[r, result.slots], result.next_token[None]])
        committed = state.commit(r, new, result.scores, rules.stopping)
        edges = schedule.observe(v, result.slots)
        looked_up = any("lookup" in v.tree.sources[node] for node in v.nodes)  # verified, as the chain route counts
        outputs.stats.record(v.size, n, committed, None, looked_up, v.depth(), edges)
        if outputs.wanted:
            outputs.emit(new[:committed], result.scores, raw[r, [0, *result.slots]])
        state.anchor_positions[r] += n + 1
        paths[r] = [0, *result.slots]
    if state.active:
        state.keep_paths(paths, fused, positions)
    schedule.time_round(time.perf_counter() - start)  # the walks read the logits on the host: the round is done


def tree_schedule(draft, target, cache, settings: DecodingConfig, stats: DSparkStats) -> TreeSchedule | None:
    """The call's :class:`TreeSchedule`, or ``None`` (chains) when it did not ask for trees or cannot have them;
    the reason for the latter goes to ``stats.tree_fallback``."""
    if settings.tree_top_k == 1:
        return None
    reason = tree_refusal(target, cache)
    if reason is not None:
        stats.tree_fallback = reason
        return None
    recalibrate = settings.confidence_recalibration and settings.priced
    recalibration = AcceptanceRecalibration(draft.config.num_draft_tokens) if recalibrate else None
    proposers = tree_proposers(draft, settings, recalibration)
    lookup = next((p for p in proposers if isinstance(p, LookupProposer)), None)
    return TreeSchedule(settings, draft.config.num_draft_tokens, proposers, lookup, recalibration)


@torch.no_grad()
def dspark_decode(
    target,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    draft: DSparkDraftModel,
    streamer=None,
    synced_gpus: bool = False,
    settings: DecodingConfig | None = None,
    **model_kwargs,
):
    """DSpark decoding with the arguments ``GenerationMixin.generate`` prepares for a decoding method.

    ``input_ids`` [R, P] is a left-padded batch. ``settings``: this call's resolved decoding settings (default: the
    draft's own, ``draft.decoding``). Returns the sequences [R, P + new] (rows that finish early are padded with the
    pad token, as plain ``generate`` does), or a :class:`DSparkGenerateOutput` (``GenerateDecoderOnlyOutput`` plus
    this call's ``dspark_stats``) when ``return_dict_in_generate``. ``draft.stats`` is the last finished call's
    statistics.
    """
    check_supported(generation_config, input_ids, model_kwargs, streamer)
    if synced_gpus:
        raise ValueError("DSpark generation does not support synced_gpus (ZeRO-3 / FSDP sharded generation).")
    if not draft.follows(target):  # first use, another target, or either moved to another dtype or device since
        draft.attach(target)
    cache, g, batch = cache_from(model_kwargs), generation_config, input_ids.shape[0]
    check_cache(cache, batch, g.max_length)
    rules = Rules(logits_processor, g.do_sample, stopping_criteria)
    pad_id = int(g._pad_token_tensor) if g._pad_token_tensor is not None else 0
    vocab_size = target.config.get_text_config().vocab_size
    stats = draft.stats = DSparkStats(num_draft_tokens=draft.config.num_draft_tokens)  # the running call's
    returned = g.return_dict_in_generate
    outputs = Outputs(stats, returned and g.output_scores, returned and g.output_logits, streamer)
    # rows leave the batch as they finish, unless the caller asked for the cache back (it then covers every row)
    compact = hasattr(cache, "batch_select_indices") and not returned
    settings = settings or draft.decoding.resolve(draft.confidence is not None)
    check_settings_fit(settings, draft)
    if g.do_sample and settings.greedy_lookahead:  # sampling keeps Algorithm 1's early stop: it is what keeps it exact
        settings = dataclasses.replace(settings, greedy_lookahead=False)
    if g.do_sample and settings.cost_recalibration:  # decisions that follow wall time would change which random
        settings = dataclasses.replace(settings, cost_recalibration=False)  # draws a seeded call makes
    schedule = Schedule(settings, draft.config.num_draft_tokens)
    with LayerTap(target, draft) as tap:
        state = prefill(target, draft, input_ids, model_kwargs, cache, tap, rules, g.max_length, pad_id, outputs)
        trees = tree_schedule(draft, target, cache, schedule.settings, stats)
        if trees is not None:
            for proposer in trees.proposers:  # the drafting proposers read the draft's context of this call
                if hasattr(proposer, "context"):
                    proposer.context = state.context
            trees.price(draft, target, state.size)
        else:
            schedule.price(draft, target, state.size, g.do_sample)
        while trees is not None and state.active:
            stats.round_rows.append([state.rows[r] for r in state.active])
            tree_round(state, trees, target, cache, tap, rules, outputs, g.max_length, pad_id)
            if compact and any(state.finished) and state.active:
                state.compact()  # the draft proposer's context is the state's: it follows
                trees.price(draft, target, profile_rows(state.size, batch))
        while state.active:
            start = time.perf_counter()
            stats.round_rows.append([state.rows[r] for r in state.active])
            plan = schedule.plan(state, g.max_length)
            proposal = draft_block(
                draft, *state.draft_inputs(), plan.max_tokens, logits_processor, g.do_sample, plan.planner
            )
            lengths = schedule.lengths(plan, proposal, state)
            stats.verify_rounds.append([lengths[r] for r in state.active])
            rows = row_proposals(plan, proposal, lengths, vocab_size, g.do_sample)
            block = verify_block(state, rows, pad_id)
            mask = state.attention_mask(block.valid)
            out, fused = target_forward(target, block.tokens, block.positions, mask, cache, tap)
            raw = out.logits.float() if out.logits.dtype != torch.float64 else out.logits
            check_finite(raw, block.valid)
            kept = accept(state, block, raw, rows, rules, outputs)
            schedule.observe(rows, kept)
            if not state.active:
                break
            state.advance(kept, fused, block.positions)
            schedule.time_round(time.perf_counter() - start)  # acceptance read the logits on the host: it is done
            if compact and any(state.finished):
                schedule.select(state.compact())
                schedule.price(draft, target, profile_rows(state.size, batch), g.do_sample)
    if streamer is not None:
        streamer.end()
    sequences = state.sequences(batch, pad_id)
    draft.stats = stats  # the last call to finish; its own stats come back on a dict output
    if not returned:
        return sequences
    return DSparkGenerateOutput(
        sequences=sequences,
        scores=tuple(outputs.scores) if outputs.want_scores else None,
        logits=tuple(outputs.logits) if outputs.want_logits else None,
        dspark_stats=stats,
        **{CACHE_FIELD: cache},
    )
