"""The tree schedule: how many nodes of each row's token tree a round verifies, and when not to draft or to draft only
the chain.

It is the call's :class:`~hf_dspark.scheduling.schedule.Schedule` (prices, back-off, observed costs) with what tree
rounds add (the rounds are ``hf_dspark.decoding.tree_rounds``): the node budget and the narrowing to the chain. Like the
rest of this package it imports nothing of the package: it reads the trees it is shown through what every token tree has
(``hf_dspark.decoding.tree.TokenTree``): ``ranked(max_depth)`` (node ids, most valuable first, parents before children),
``values``, ``depths``, ``parents``, ``top``, ``sources`` and ``drafted``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .backoff import Backoff
from .modes import choose_tree_nodes
from .policy import SPSProfile, lookahead_tree_settled, tree_rate
from .schedule import Schedule


@dataclass
class TreeSchedule(Schedule):
    """How many of each row's ranked nodes a round verifies (at most ``budget``), and when not to draft.

    ``fixed`` verifies each row's most valuable nodes up to the budget; ``threshold`` those worth at least
    ``threshold``; ``scheduled``/``async`` run Algorithm 1 over the nodes: admit them in order of value (parents
    first) while Θ(B) = (R + Σ values) · SPS(R · (1 + B)) rises, stop at the first that does not raise it, with the
    trees' drafting cost added to every step. In a batch the unit of admission is a rank: the verify is padded to
    the widest row, so the B-th best node of every row is admitted together (summed values), as chains admit
    columns. A drafted round that was not worth a plain step in expectation turns drafting off for some rounds
    (the :class:`Schedule`'s back-off, as for chains); lookup branches, which cost nothing to draft, are still
    verified then, and the round that drafts again probes with the chain at the chain's cost. A drafted round whose
    chain alone (the draft's top children, and the lookup branches) at a chain's drafting cost would have been
    worth more than the tree at a tree's (Θ each, :func:`tree_rate`) narrows the next drafted rounds to the chain
    (``narrowing``: a back-off, reset by a tree round worth more than its chain): under load a batch's trees shrink
    to chains, and so does their drafting cost. ``drafting`` is one round's tree drafting for the batch (one
    backbone pass, every row's head)."""

    budget: int = field(kw_only=True)  # the most nodes a row verifies in a round
    chain_drafting: float | None = None  # seconds of a round that drafts only the chain (None: never narrow)
    narrowing: Backoff = field(default_factory=Backoff)  # drafted rounds that draft the chain instead of the tree
    chain_round: bool = False  # whether this round drafts the chain only (narrowed, or probing after a back-off)

    def set_prices(self, sps: SPSProfile, drafting: float, rows: int, chain_drafting: float | None = None) -> None:
        """:meth:`Schedule.set_prices`, and a round that drafts only the chain at ``chain_drafting`` seconds."""
        super().set_prices(sps, drafting, rows)
        self.chain_drafting = chain_drafting

    @property
    def round_drafting(self) -> float:
        """Seconds this round's drafting costs the batch: the chain's when it drafts only the chain, else the tree's."""
        return self.chain_drafting if self.chain_round else self.drafting

    def start_round(self) -> bool:
        """A round begins: -> whether it drafts (:meth:`Schedule.start_round`); sets whether it drafts only the chain
        (narrowed, or the probe after a back-off, which tries drafting again at the chain's cost)."""
        draft = super().start_round()
        self.chain_round = (
            draft and bool(self.narrowing.left or self.backoff.length) and self.chain_drafting is not None
        )
        return draft

    def count(self, values: list[float], rows: int, generating: int, drafted: bool) -> tuple[int, bool]:
        """How many of the leading ranked nodes a round verifies, ``values`` their (summed over rows) values,
        ``drafted`` whether the round's draft pass ran (priced once for the batch), and whether drafting paid
        (:func:`~hf_dspark.scheduling.modes.choose_tree_nodes`, priced when the mode is)."""
        if not self.priced:
            return choose_tree_nodes(self.mode, values, None, self.threshold)
        return self.count_at(values, rows, generating, self.round_drafting if drafted else 0.0)

    def count_at(self, values: list[float], rows: int, generating: int, drafting: float) -> tuple[int, bool]:
        """:meth:`count` for a priced round drafted at ``drafting`` seconds; whether it pays is judged against a
        plain step by the premium the call's rounds showed (1 before any, or with a profile the user set)."""
        return choose_tree_nodes(self.mode, values, self.sps, self.threshold, drafting, rows, generating,
                                 self.lookahead, self.premium)  # fmt: skip

    def settled(self, rows: int, max_depth: int, tree, bound: float, depth: int) -> bool:
        """Whether one generating row's choice from the drafted ``tree`` is final while nodes are still to come,
        each worth at most ``bound`` and deeper than ``depth``: the choice must stop at a node (not take them all)
        that ranks before any such node, i.e. worth more than ``bound``, or exactly ``bound`` and no deeper than
        them (ties rank the shallower first). Every node up to and including the one it stopped at keeps its rank
        then, so :meth:`select` takes the same nodes as from the whole tree (the early stop reads no further)."""
        ranked = tree.ranked(max_depth)[: self.budget]
        values = [tree.values[n] for n in ranked]
        count = self.count(values, rows, 1, True)[0]
        if self.priced and self.lookahead:  # the choice may still grow past a drop: bound it
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

    def select(self, trees: list, max_depths: list[int], rows: int) -> list[list[int]]:
        """Each tree's verified nodes (``max_depths``: the deepest its row may verify), parents before children, in
        a verify padded over ``rows`` batch rows."""
        ranked = [tree.ranked(depth)[: self.budget] for tree, depth in zip(trees, max_depths, strict=True)]
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
                count, pays = self.count(summed, rows, len(trees), drafted)
            counts = [count] * len(ranked)
            self.expect(drafted, rows * (1 + count), self.round_drafting if drafted else 0.0)
            if drafted:  # back off when this drafted round is not worth a plain step in expectation
                if self.chain_round:  # nothing to weigh: it drafted no branches
                    self.narrowing.sit_out()
                elif self.chain_drafting is not None:
                    pays = self.weigh_chain(trees, ranked, summed, count, rows, len(trees)) or pays
                self.backoff.judge(pays)
        else:
            counts = [self.count(v, rows, 1, False)[0] for v in values]
        return [
            sorted(nodes[:count], key=lambda n, tree=tree: (tree.depths[n], n))
            for tree, nodes, count in zip(trees, ranked, counts, strict=True)
        ]

    def weigh_chain(
        self, trees: list, ranked: list[list[int]], summed: list[float], count: int, rows: int, generating: int
    ) -> bool:
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


def _rank_sums(values: list[list[float]]) -> list[float]:
    """Per rank i, the sum over rows of each row's i-th value (rows with fewer values add nothing): a padded batch
    admits the i-th node of every row together."""
    return [sum(v[i] for v in values if i < len(v)) for i in range(max(map(len, values), default=0))]


def _chain_nodes(tree) -> set[int]:
    """The nodes a narrowed round would have drafted: those whose every node from the anchor is the draft's top
    child or a lookup branch's (parents come before their children in a tree)."""
    chain: set[int] = set()
    for node, parent in enumerate(tree.parents):
        if (tree.top[node] or "lookup" in tree.sources[node]) and (parent < 0 or parent in chain):
            chain.add(node)
    return chain
