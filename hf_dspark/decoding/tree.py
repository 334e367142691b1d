"""Token trees: several continuations verified in one target forward (docs/method.md, "Token trees").

A round's candidates form a tree rooted at the row's anchor. Node i holds a token, its parent (-1: the anchor),
its depth and a value: the estimated probability that the target's own path reaches it. Proposers
(:mod:`hf_dspark.decoding.proposers`) add nodes; a continuation that shares a prefix with one already there joins it, so
every distinct prefix is one node.

    TokenTree.select    the nodes a round verifies: the most valuable, ancestors first (values fall along paths)
    VerifiedTree        what a row verifies as a verify block: a tree's chosen nodes, or a chain (a tree of width one)
    tree_attention_mask one verify of every row's tree: each row its own ancestor mask, padded to the widest

The target sees the verified nodes in one forward: each attends to the committed cache and to its ancestors (a 4D
mask; a batch of chains needs only the causal one), at position anchor + depth. Exact acceptance over the verified
tree is :func:`hf_dspark.decoding.verify.walk`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch


@dataclass
class TokenTree:
    """Candidate continuations of one row after its anchor. ``edges[i]`` is node i's value relative to its parent
    (the estimated probability that the target takes it once the parent is reached); ``values[i]`` the product
    along its path. ``top[i]``: the draft's most likely child of its parent (the confidence head values those;
    the others are valued from the draft's probabilities); ``sources[i]``: the proposers that made it."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    edges: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    top: list[bool] = field(default_factory=list)
    sources: list[set[str]] = field(default_factory=list)
    index: dict[tuple[int, int], int] = field(default_factory=dict)  # (parent, token) -> node
    confidences: dict[int, float] = field(default_factory=dict)  # top draft node -> the head's own c_k (unshifted)
    probs: dict[int, torch.Tensor] = field(default_factory=dict)  # sampled node -> the q [V] it was drawn from
    drafted: bool = False  # whether the draft added nodes (the round paid for its pass)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(
        self, parent: int, token: int, edge: float, source: str, top: bool = False, probs: torch.Tensor | None = None
    ) -> int:
        """Node for ``token`` under ``parent`` (-1: the anchor), valued ``edge`` × the parent's value; a node that
        exists already keeps the larger value (its ancestors are raised to it, so values never grow along a path).
        ``probs``: the distribution q [V] the token was drawn from, when the proposer sampled it (acceptance then
        tests it against q). -> the node's index."""
        self.drafted = self.drafted or source == "draft"
        node = self.index.get((parent, token))
        if probs is not None:
            self.probs[node if node is not None else len(self.tokens)] = probs
        base = 1.0 if parent < 0 else self.values[parent]
        if node is None:
            node = len(self.tokens)
            self.index[(parent, token)] = node
            self.tokens.append(token)
            self.parents.append(parent)
            self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
            self.edges.append(edge)
            self.values.append(base * edge)
            self.top.append(top)
            self.sources.append({source})
            return node
        self.sources[node].add(source)
        self.top[node] = self.top[node] or top
        if edge > self.edges[node]:
            self.edges[node], self.values[node] = edge, base * edge
        return node

    def add_path(self, tokens: list[int], edges: list[float], source: str) -> list[int]:
        """A continuation from the anchor, merged into the nodes it shares a prefix with. -> its nodes."""
        nodes, parent = [], -1
        for token, edge in zip(tokens, edges, strict=True):
            parent = self.add(parent, int(token), edge, source)
            nodes.append(parent)
        self._monotone()
        return nodes

    def add_continuation(self, tokens: torch.Tensor, edge: float, source: str) -> None:
        """A proposer's continuation ``tokens`` [k] from the anchor, each token valued ``edge`` given its parent."""
        self.add_path(tokens.tolist(), [edge] * tokens.shape[0], source)

    def _monotone(self) -> None:
        """Raise every ancestor to its best descendant's value (children come after their parents)."""
        for node in range(len(self) - 1, -1, -1):
            parent = self.parents[node]
            if parent >= 0 and self.values[parent] < self.values[node]:
                self.values[parent] = self.values[node]

    def ranked(self, max_depth: int) -> list[int]:
        """Nodes of positive value no deeper than ``max_depth``, most valuable first; a node's parent always comes
        before it (values fall along paths; ties go to the shallower, then the older node)."""
        order = sorted(range(len(self)), key=lambda i: (-self.values[i], self.depths[i], i))
        chosen: set[int] = set()
        ranked = []
        for node in order:
            if self.values[node] <= 0 or self.depths[node] > max_depth:
                continue
            if self.parents[node] < 0 or self.parents[node] in chosen:
                chosen.add(node)
                ranked.append(node)
        return ranked

    def select(self, budget: int, max_depth: int) -> list[int]:
        """The ``budget`` most valuable nodes (ancestor-closed, depth ≤ ``max_depth``), ordered by depth so every
        parent precedes its children in the verify block."""
        chosen = self.ranked(max_depth)[:budget]
        return sorted(chosen, key=lambda i: (self.depths[i], i))


@dataclass
class VerifiedTree:
    """The candidates a row verifies in a round, as a verify block of 1 + B slots (slot 0: the anchor): each slot's
    token ``slot_tokens`` [B] and depth, and ``parent_slots[s]`` its parent's slot (-1 for the anchor). A chain is a
    tree of width one (each slot's parent the slot before it): a drafted block, a lookup continuation. ``probs``
    [B, V]: the distributions a sampled chain's tokens were drawn from (one-hot for a looked-up token), which exact
    acceptance tests them against; ``None`` for deterministic candidates (a tree's top children), which the target's
    own draw picks among. ``tree``/``nodes``: the token tree and its nodes in slots 1..B, when a tree proposed them."""

    parent_slots: list[int]
    slot_depths: list[int]
    slot_tokens: torch.Tensor
    probs: torch.Tensor | None = None
    tree: TokenTree | None = None
    nodes: list[int] = field(default_factory=list)
    sampled: dict[int, torch.Tensor] = field(default_factory=dict)  # slot -> q [V], for a tree's sampled nodes
    deterministic: set[int] = field(default_factory=set)  # of those slots, the ones another proposer also proposed

    @classmethod
    def of(cls, tree: TokenTree, nodes: list[int]) -> VerifiedTree:
        """``nodes`` of ``tree`` (parents before children) in slots 1..B. A chain of sampled nodes alone (one
        proposer's draws) carries their q as ``probs``; otherwise each sampled node's q is kept by slot."""
        slot_of = {-1: 0, **{node: s + 1 for s, node in enumerate(nodes)}}
        parent_slots = [-1] + [slot_of[tree.parents[node]] for node in nodes]
        tokens = torch.tensor([tree.tokens[node] for node in nodes], dtype=torch.long)
        verified = cls(parent_slots, [tree.depths[node] for node in nodes], tokens, tree=tree, nodes=nodes)
        sampled = {s: tree.probs[node] for s, node in enumerate(nodes, start=1) if node in tree.probs}
        also_proposed = {s for s in sampled if len(tree.sources[nodes[s - 1]]) > 1}
        if sampled and len(sampled) == len(nodes) and not also_proposed and verified.is_chain:
            verified.probs = torch.stack([sampled[s] for s in range(1, len(nodes) + 1)])
        elif sampled:
            verified.sampled, verified.deterministic = sampled, also_proposed
        return verified

    @classmethod
    def chain(cls, tokens: torch.Tensor, probs: torch.Tensor | None = None) -> VerifiedTree:
        """A chain of ``tokens`` [ℓ] (any device; no host copy), drawn from ``probs`` [ℓ, V] when sampled."""
        ell = tokens.shape[0]
        return cls(list(range(-1, ell)), list(range(1, ell + 1)), tokens, probs)

    @property
    def size(self) -> int:
        """Candidates verified (B; the block has B + 1 slots)."""
        return len(self.parent_slots) - 1

    @functools.cached_property
    def children(self) -> dict[tuple[int, int], int]:
        """(slot, token) -> the slot of that child of the slot."""
        tokens = self.slot_tokens.tolist()
        return {(self.parent_slots[s], tokens[s - 1]): s for s in range(1, len(self.parent_slots))}

    @functools.cached_property
    def is_chain(self) -> bool:
        """Whether every slot's parent is the slot before it (a chain, or the anchor alone)."""
        return all(parent == s - 1 for s, parent in enumerate(self.parent_slots))

    def depth(self) -> int:
        return max(self.slot_depths, default=0)

    def ancestors(self, device) -> torch.Tensor:
        """[1 + B, 1 + B] bool: slot i may attend to slot j (j is i or one of its ancestors)."""
        n = len(self.parent_slots)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for s, parent in enumerate(self.parent_slots):
            if parent >= 0:
                mask[s] = mask[parent]
            mask[s, s] = True
        return mask.to(device)

    def attention_mask(self, cache_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The target's 4D additive mask [1, 1, 1 + B, S + 1 + B] for this tree alone: :func:`tree_attention_mask`."""
        return tree_attention_mask([self], cache_mask, dtype)


def tree_attention_mask(
    trees: list[VerifiedTree | None], cache_mask: torch.Tensor, dtype: torch.dtype, width: int | None = None
) -> torch.Tensor:
    """The target's 4D additive mask [R, 1, W, S + W] for one verify of each row's tree, padded to W = ``width``
    (default: 1 + the largest B): row r's slots attend to the row's committed cache slots (``cache_mask`` [R, S],
    1: holds a committed token) and to their own ancestors in the row's tree; padding slots, and every slot of a
    row without a tree (``None``: it finished), attend to themselves alone (a row of the mask must allow
    something). 0 where a slot may attend, the dtype's minimum elsewhere (eager attention adds the mask, SDPA takes
    a float mask as a bias)."""
    R, S = cache_mask.shape
    width = width or 1 + max((tree.size for tree in trees if tree is not None), default=0)
    allowed = torch.zeros(R, width, S + width, dtype=torch.bool, device=cache_mask.device)
    allowed[:, :, S:] = torch.eye(width, dtype=torch.bool, device=cache_mask.device)
    for r, tree in enumerate(trees):
        if tree is not None:
            n = 1 + tree.size
            allowed[r, :n, :S] = cache_mask[r].bool()
            allowed[r, :n, S : S + n] = tree.ancestors(cache_mask.device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=cache_mask.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]
