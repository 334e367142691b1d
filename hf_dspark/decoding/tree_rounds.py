"""Token-tree rounds (``tree_top_k`` > 1): each generating row proposes a tree, the schedule chooses the nodes to
verify, one forward verifies every row's nodes, each row walks its accepted path exactly.

    TreeSchedule.requests  what each row asks of the proposers this round (drafting or backing off, narrowed or not)
    propose_trees          (proposers.py) every proposer's candidates, shared prefixes merged
    TreeSchedule.select    the nodes each row verifies: the mode's count of its ranked nodes; back-off, narrowing
    tree_round             one round: the above, then the one verify (verification.py) of every row's nodes
    tree_schedule          the call's schedule, or None (chains) when it cannot have trees
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial

import torch

from ..scheduling.backoff import Backoff
from ..scheduling.modes import choose_tree_nodes
from ..scheduling.observed import ObservedRounds, premium
from ..scheduling.policy import SPSProfile, lookahead_tree_settled, tree_rate, width_buckets
from ..scheduling.recalibration import AcceptanceRecalibration
from ..settings import MAX_VERIFY_WIDTH, DecodingConfig
from .checks import tree_refusal
from .costs import PricedRounds, observed_rounds, sps_profile, tree_draft_seconds
from .drafting import DraftContext
from .lookup import LookupProposer
from .proposers import TreeRequest, propose_trees, tree_proposers
from .state import Call, DecodeState
from .stats import DSparkStats
from .tree import TokenTree, VerifiedTree
from .verification import verify


@dataclass
class TreeSchedule(PricedRounds):
    """Token-tree rounds (``settings.tree_top_k`` > 1), each row its own tree: the proposers, how many nodes a row
    verifies per round (``verify_limit``, ``None``: γ · ``tree_top_k``), and when not to draft.

    ``fixed`` verifies each row's most valuable nodes up to the limit; ``threshold`` those worth at least
    ``confidence_threshold``; ``scheduled``/``async`` run Algorithm 1 over the nodes: admit them in order of value
    (parents first) while Θ(B) = (R + Σ values) · SPS(R · (1 + B)) rises, stop at the first that does not raise it,
    with the trees' drafting cost added to every step. In a batch the unit of admission is a rank: the verify is
    padded to the widest row, so the B-th best node of every row is admitted together (summed values), as chains
    admit columns. A drafted round that was not worth a plain step in expectation turns drafting off for some
    rounds (``backoff``, as for chains); lookup branches, which cost nothing to draft, are still verified then, and the
    round that drafts again probes with the chain at the chain's cost. A drafted round whose chain alone (the
    draft's top children, and the lookup branches) at a chain's drafting cost would have been worth more than the
    tree at a tree's (Θ each, :func:`tree_rate`) narrows the next drafted rounds to the chain
    (``narrowing``: a back-off, reset by a tree round worth more than its chain): under load a batch's trees
    shrink to chains, and so does their drafting cost. With measured costs (no ``draft.sps_profile`` set) and
    ``cost_recalibration``, a drafted round must beat a plain step by the premium the call's own rounds showed
    (:class:`~hf_dspark.scheduling.observed.ObservedRounds`)."""

    settings: DecodingConfig
    draft_tokens: int
    proposers: list
    lookup: LookupProposer | None
    recalibration: AcceptanceRecalibration | None = None  # the draft proposer's, fed here from each walk
    sps: SPSProfile | None = None
    drafting: float = 0.0  # seconds one round's tree drafting costs the batch (one backbone pass, every row's head)
    chain_drafting: float | None = None  # seconds of a round that drafts only the chain (None: never narrow)
    backoff: Backoff = field(default_factory=Backoff)  # rounds that do not draft after a round that did not pay
    narrowing: Backoff = field(default_factory=Backoff)  # drafted rounds that draft the chain instead of the tree
    chain_round: bool = False  # whether this round drafts the chain only (narrowed, or probing after a back-off)
    observed: ObservedRounds | None = None  # measured costs: the call's rounds as they ran against their prices
    buckets: tuple[int, ...] | None = None  # the widths verifies pad to (``verify_buckets``)

    def __post_init__(self):
        if self.settings.verify_buckets:
            self.buckets = width_buckets(1 + self.budget)

    @property
    def budget(self) -> int:
        s = self.settings
        return s.verify_limit if s.verify_limit is not None else min(self.draft_tokens * s.tree_top_k, MAX_VERIFY_WIDTH)

    def price(self, call: Call, rows: int, measured_rows: int | None = None) -> None:
        """Price verifies of ``rows`` batch rows up to the node budget (with the profiles measured for
        ``measured_rows``, default ``rows``; each width at its bucket's cost with ``buckets``), and a round of tree
        drafting for them (the rows share the backbone pass: pricing each row at one row's cost overprices a
        batch's drafting R-fold, and the schedule then backs off from trees a batch would have gained from)."""
        draft, measured = call.draft, measured_rows or rows
        if self.priced:
            sps = sps_profile(draft, call.target, measured, max_width=self.budget + 1)
            self.sps = sps.bucketed(self.buckets, rows)
            self.drafting = tree_draft_seconds(draft, self.settings.tree_top_k, measured)
            self.chain_drafting = tree_draft_seconds(draft, 1, measured)
            self.observed = observed_rounds(self.observed, draft, self.settings.cost_recalibration)

    @property
    def round_drafting(self) -> float:
        """Seconds this round's drafting costs the batch: the chain's when it drafts only the chain, else the tree's."""
        return self.chain_drafting if self.chain_round else self.drafting

    def requests(self, state: DecodeState, max_length: int, processors, sample: bool = False) -> list[TreeRequest]:
        """One request per generating row (``sample``: the call samples)."""
        room = state.room(max(self.draft_tokens, self.lookup.max_tokens if self.lookup else 0), max_length)
        draft = not self.backoff.sit_out()
        # a round after a back-off probes whether drafting pays again: with the chain, at the chain's cost
        self.chain_round = (
            draft and bool(self.narrowing.left or self.backoff.length) and self.chain_drafting is not None
        )
        top_k = 1 if self.chain_round else None
        # one generating row's choice is its own tree's (a batch's sums every row's, known only once all are drafted);
        # merged lookup nodes join after the draft's, so its expansion cannot know the choice before they do
        early = len(state.active) == 1 and not (self.settings.tree_lookup_merge and self.lookup is not None)
        requests = []
        for r in state.active:
            settled = partial(self.settled, state.size, room[r]) if early else None
            requests.append(TreeRequest(r, state.history(r), state.anchor_positions[r], room[r], self.budget,
                                        processors, draft, top_k, sample, settled))  # fmt: skip
        return requests

    def count(self, values: list[float], rows: int, generating: int, drafted: bool) -> tuple[int, bool]:
        """How many of the leading ranked nodes a round verifies, ``values`` their (summed over rows) values,
        ``drafted`` whether the round's draft pass ran (priced once for the batch), and whether drafting paid
        (:func:`~hf_dspark.scheduling.modes.choose_tree_nodes`, priced when the mode is)."""
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
                    self.narrowing.sit_out()
                elif self.chain_drafting is not None:
                    pays = self.weigh_chain(trees, ranked, summed, count, rows, len(requests)) or pays
                self.backoff.judge(pays)
        else:
            counts = [self.count(v, rows, 1, False)[0] for v in values]
        return [
            sorted(nodes[:count], key=lambda n, tree=tree: (tree.depths[n], n))
            for tree, nodes, count in zip(trees, ranked, counts, strict=True)
        ]

    def round(self, call: Call, state: DecodeState) -> None:
        tree_round(call, self, state)

    def keep_rows(self, index: torch.Tensor) -> None:
        """Nothing per row to keep (the proposers' context is the state's, which compacts itself)."""

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
        self.narrowing.judge(chain_theta <= tree_theta)  # a tree round only runs with no narrowed rounds left
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
            looked_up = [s for s, node in enumerate(verified.nodes, start=1) if "lookup" in tree.sources[node]]
            self.lookup.observe_width(len(looked_up), sum(s in on_path for s in looked_up))
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


def tree_round(call: Call, schedule: TreeSchedule, state: DecodeState) -> None:
    """One round of trees: each generating row proposes its tree, the schedule chooses its nodes, and every row's
    chosen nodes go through the one verify (:func:`~hf_dspark.decoding.verification.verify`: one forward, each
    row's ancestor mask and depth positions, exact walks, both caches keep exactly the accepted paths)."""
    start, outputs = time.perf_counter(), call.outputs
    requests = schedule.requests(state, call.max_length, call.rules.processors, call.rules.do_sample)
    outputs.stats.narrowed_rounds += any(request.draft and request.top_k == 1 for request in requests)
    trees = propose_trees(schedule.proposers, requests)
    chosen = schedule.select(trees, requests, state.size)
    verified: list[VerifiedTree | None] = [None] * state.size
    for request, tree, nodes in zip(requests, trees, chosen, strict=True):
        verified[request.row] = VerifiedTree.of(tree, nodes)
    outputs.stats.verify_rounds.append([verified[r].size for r in state.active])
    walks = verify(call, state, verified, schedule.buckets)
    for request in requests:
        v, result = verified[request.row], walks[request.row]
        edges = schedule.observe(v, result.slots)
        looked_up = any("lookup" in v.tree.sources[node] for node in v.nodes)  # verified, as the chain route counts
        outputs.stats.record(v.size, len(result.slots), result.committed, None, looked_up, v.depth(), edges)
    schedule.time_round(time.perf_counter() - start)  # the walks read the logits on the host: the round is done


def tree_schedule(
    draft, target, cache, settings: DecodingConfig, stats: DSparkStats, context: DraftContext
) -> TreeSchedule | None:
    """The call's :class:`TreeSchedule`, its drafting proposers reading the call's draft ``context``, or ``None``
    (chains) when it did not ask for trees or cannot have them; the reason for the latter goes to
    ``stats.tree_fallback``."""
    if settings.tree_top_k == 1:
        return None
    reason = tree_refusal(target, cache)
    if reason is not None:
        stats.tree_fallback = reason
        return None
    recalibrate = settings.confidence_recalibration and settings.priced
    recalibration = AcceptanceRecalibration(draft.config.num_draft_tokens) if recalibrate else None
    proposers = tree_proposers(draft, settings, recalibration)
    for proposer in proposers:  # the drafting proposers read the draft's context of this call (it follows compact)
        if hasattr(proposer, "context"):
            proposer.context = context
    lookup = next((p for p in proposers if isinstance(p, LookupProposer)), None)
    return TreeSchedule(settings, draft.config.num_draft_tokens, proposers, lookup, recalibration)
