"""Token-tree rounds (``tree_top_k`` > 1): each generating row proposes a tree, the schedule chooses the nodes to
verify, one forward verifies every row's nodes, each row walks its accepted path exactly.

    TreeRounds.requests  what each row asks of the proposers this round (drafting or backing off, narrowed or not)
    propose              (proposers.py) every proposer's candidates, shared prefixes merged into one tree a row
    TreeRounds.choose    the nodes each row verifies: the mode's count of its ranked nodes; back-off, narrowing
    TreeRounds.observe   the stats, and what the walks teach the lookup and the recalibration
    tree_schedule        the call's rounds, or None (chains) when it cannot have trees

The round itself is the loop's one round (``loop.play_round``), shared with chain rounds: propose, choose, one
verify (verification.py), observe. What carries over between rounds (prices, back-off, narrowing, the observed
costs) is the call's :class:`~hf_dspark.scheduling.trees.TreeSchedule`, pure and apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from ..scheduling.policy import width_buckets
from ..scheduling.recalibration import AcceptanceRecalibration
from ..scheduling.trees import TreeSchedule
from ..settings import MAX_VERIFY_WIDTH, DecodingConfig
from .checks import tree_refusal
from .costs import PricedRounds, observed_rounds, sps_profile, tree_draft_seconds
from .drafting import DraftContext
from .lookup import LookupProposer
from .proposers import RowRequest, tree_proposers
from .state import Call, DecodeState
from .stats import DSparkStats
from .tree import TokenTree, VerifiedTree
from .verify import Walk


@dataclass
class TreeRounds(PricedRounds):
    """A call's token-tree rounds (``settings.tree_top_k`` > 1), each row its own tree: the proposers, what each
    row asks of them, and what the walks teach the lookup and the recalibration; how many nodes a row verifies
    (at most ``budget``: ``verify_limit``, or γ · ``tree_top_k`` within 256) and when not to draft or to draft
    only the chain is the call's :class:`~hf_dspark.scheduling.trees.TreeSchedule`, which carries that state
    between rounds."""

    settings: DecodingConfig
    draft_tokens: int
    proposers: list
    lookup: LookupProposer | None
    recalibration: AcceptanceRecalibration | None = None  # the draft proposer's, fed here from each walk
    schedule: TreeSchedule = field(init=False)  # made from the settings
    empty = TokenTree  # a row's candidates start as an empty tree

    def __post_init__(self):
        s = self.settings
        budget = min(self.draft_tokens * s.tree_top_k, MAX_VERIFY_WIDTH) if s.verify_limit is None else s.verify_limit
        buckets = width_buckets(1 + budget, 1 + self.draft_tokens) if s.verify_buckets else None
        self.schedule = TreeSchedule(s.verify_mode, s.confidence_threshold, s.greedy_lookahead, buckets, budget=budget)

    @property
    def budget(self) -> int:
        """The most nodes a row verifies in a round (the schedule's, fixed for the call)."""
        return self.schedule.budget

    def price(self, call: Call, rows: int, measured_rows: int | None = None) -> None:
        """Price verifies of ``rows`` batch rows up to the node budget (with the profiles measured for
        ``measured_rows``, default ``rows``), and a round of tree drafting for them (the rows share the backbone
        pass: pricing each row at one row's cost overprices a batch's drafting R-fold, and the schedule then backs
        off from trees a batch would have gained from)."""
        draft, measured = call.draft, measured_rows or rows
        if self.priced:
            sps = sps_profile(draft, call.target, measured, max_width=self.budget + 1)
            drafting = tree_draft_seconds(draft, self.settings.tree_top_k, measured)
            self.schedule.set_prices(sps, drafting, rows, tree_draft_seconds(draft, 1, measured))
            self.schedule.observed = observed_rounds(self.observed, draft, self.settings.cost_recalibration)

    def requests(self, state: DecodeState, max_length: int, processors, sample: bool = False) -> list[RowRequest]:
        """One request per generating row (``sample``: the call samples)."""
        room = state.room(max(self.draft_tokens, self.lookup.max_tokens if self.lookup else 0), max_length)
        draft = self.schedule.start_round()
        top_k = 1 if self.schedule.chain_round else None
        # one generating row's choice is its own tree's (a batch's sums every row's, known only once all are drafted);
        # merged lookup nodes join after the draft's, so its expansion cannot know the choice before they do
        early = len(state.active) == 1 and not (self.settings.tree_lookup_merge and self.lookup is not None)
        requests = []
        budget = self.budget
        for r in state.active:
            settled = partial(self.schedule.settled, state.size, room[r]) if early else None
            requests.append(RowRequest(r, state.history(r), state.anchor_positions[r], room[r], budget,
                                        processors, draft, top_k, sample, settled))  # fmt: skip
        return requests

    def select(self, trees: list[TokenTree], requests: list[RowRequest], rows: int) -> list[list[int]]:
        """Each request's verified nodes, parents before children, in a verify padded over ``rows`` batch rows
        (:meth:`TreeSchedule.select`)."""
        return self.schedule.select(trees, [request.max_depth for request in requests], rows)

    def choose(
        self, call: Call, candidates: list[TokenTree], requests: list[RowRequest], state: DecodeState
    ) -> list[VerifiedTree | None]:
        """Each generating row's chosen nodes (:meth:`select`) as its verified tree; None for a finished row."""
        verified: list[VerifiedTree | None] = [None] * state.size
        chosen = self.select(candidates, requests, state.size)
        for request, tree, nodes in zip(requests, candidates, chosen, strict=True):
            verified[request.row] = VerifiedTree.of(tree, nodes)
        return verified

    def observe(
        self,
        call: Call,
        candidates: list[TokenTree],
        requests: list[RowRequest],
        verified: list[VerifiedTree | None],
        walks: list[Walk | None],
    ) -> None:
        """After the verify: each row's stats (a round counts as looked up when it verified a lookup branch,
        accepted or not, as the chain route counts it), and what its walk teaches (:meth:`learn`)."""
        stats = call.outputs.stats
        stats.narrowed_rounds += any(request.draft and request.top_k == 1 for request in requests)
        for request in requests:
            v, result = verified[request.row], walks[request.row]
            edges = self.learn(v, result.slots)
            looked_up = any("lookup" in v.tree.sources[node] for node in v.nodes)
            stats.record(v.size, len(result.slots), result.committed, None, looked_up, v.depth(), edges)

    def keep_rows(self, index: torch.Tensor) -> None:
        """Nothing per row to keep (the proposers' context is the state's, which compacts itself)."""

    def learn(self, verified: VerifiedTree, path: list[int]) -> list[tuple[float, bool, bool]]:
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


def tree_schedule(
    draft, target, cache, settings: DecodingConfig, stats: DSparkStats, context: DraftContext
) -> TreeRounds | None:
    """The call's :class:`TreeRounds`, its drafting proposers reading the call's draft ``context``, or ``None``
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
    return TreeRounds(settings, draft.config.num_draft_tokens, proposers, lookup, recalibration)
