"""Token trees: several continuations verified in one target forward (docs/method.md, "Token trees").

A round's candidates form a tree rooted at the row's anchor. Node i holds a token, its parent (-1: the anchor),
its depth and a value: the estimated probability that the target's own path reaches it. Proposers
(:mod:`hf_dspark.decoding.proposers`) add nodes; a continuation that shares a prefix with one already there joins it, so
every distinct prefix is one node.

    TokenTree.select    the nodes a round verifies: the most valuable, ancestors first (values fall along paths)
    VerifiedTree        those nodes as a verify block: tokens, depth positions, the ancestor mask
    tree_attention_mask one verify of every row's tree: each row its own ancestor mask, padded to the widest
    walk                exact acceptance: descend while the target's own choice is a child

The target sees the verified nodes in one forward: each attends to the committed cache and to its ancestors (a 4D
mask), at position anchor + depth. Acceptance starts at the anchor; at each node the target chooses a token exactly
as plain decoding would (the argmax, or a sample of its processed distribution given the node's path); if that token
is a child, the walk goes on from the child, else it is the round's correction token. Every committed token is the
target's own choice given the committed prefix, so the output is the target's, greedy or sampled, whatever the
tree (it must only not depend on the target's random draws, and it is built before the target runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.generation import LogitsProcessorList

from .verify import probs, process


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
    drafted: bool = False  # whether the draft added nodes (the round paid for its pass)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, edge: float, source: str, top: bool = False) -> int:
        """Node for ``token`` under ``parent`` (-1: the anchor), valued ``edge`` × the parent's value; a node that
        exists already keeps the larger value (its ancestors are raised to it, so values never grow along a path).
        -> the node's index."""
        self.drafted = self.drafted or source == "draft"
        node = self.index.get((parent, token))
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
    """The nodes a round verifies, as a verify block of 1 + B slots (slot 0: the anchor). ``nodes[s - 1]`` is the
    tree node in slot s; ``parent_slots[s]`` its parent's slot (-1 for the anchor); ``children[(s, token)]``
    the slot of that child of slot s."""

    tree: TokenTree
    nodes: list[int]
    parent_slots: list[int]
    children: dict[tuple[int, int], int]

    @classmethod
    def of(cls, tree: TokenTree, nodes: list[int]) -> VerifiedTree:
        slot_of = {-1: 0, **{node: s + 1 for s, node in enumerate(nodes)}}
        parent_slots = [-1] + [slot_of[tree.parents[node]] for node in nodes]
        children = {(slot_of[tree.parents[node]], tree.tokens[node]): slot_of[node] for node in nodes}
        return cls(tree, nodes, parent_slots, children)

    @property
    def size(self) -> int:
        """Draft nodes verified (B; the block has B + 1 slots)."""
        return len(self.nodes)

    @property
    def is_chain(self) -> bool:
        """Whether every slot's parent is the slot before it (a chain, or the anchor alone)."""
        return all(parent == s - 1 for s, parent in enumerate(self.parent_slots))

    def depth(self) -> int:
        return max((self.tree.depths[n] for n in self.nodes), default=0)

    def tokens(self, anchor: int, device) -> torch.Tensor:
        """[1, 1 + B]: the anchor, then each slot's token."""
        return torch.tensor([[anchor, *(self.tree.tokens[n] for n in self.nodes)]], device=device)

    def positions(self, anchor_position: int, device) -> torch.Tensor:
        """[1, 1 + B]: anchor position + depth."""
        return anchor_position + torch.tensor([[0, *(self.tree.depths[n] for n in self.nodes)]], device=device)

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


def tree_attention_mask(trees: list[VerifiedTree | None], cache_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The target's 4D additive mask [R, 1, W, S + W] for one verify of each row's tree, padded to W = 1 + the
    largest B: row r's slots attend to the row's committed cache slots (``cache_mask`` [R, S], 1: holds a committed
    token) and to their own ancestors in the row's tree; padding slots, and every slot of a row without a tree
    (``None``: it finished), attend to themselves alone (a row of the mask must allow something). 0 where a slot may
    attend, the dtype's minimum elsewhere (eager attention adds the mask, SDPA takes a float mask as a bias)."""
    R, S = cache_mask.shape
    width = 1 + max((tree.size for tree in trees if tree is not None), default=0)
    allowed = torch.zeros(R, width, S + width, dtype=torch.bool, device=cache_mask.device)
    allowed[:, :, S:] = torch.eye(width, dtype=torch.bool, device=cache_mask.device)
    for r, tree in enumerate(trees):
        if tree is not None:
            n = 1 + tree.size
            allowed[r, :n, :S] = cache_mask[r].bool()
            allowed[r, :n, S : S + n] = tree.ancestors(cache_mask.device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=cache_mask.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


@dataclass
class Walk:
    """What exact acceptance found: ``slots`` the accepted nodes' slots, root to leaf; ``next_token`` the target's
    choice after them (the correction or bonus token); ``scores`` [n + 1, V] the processed target scores at the
    anchor and at each accepted slot (the ones plain decoding would have seen)."""

    slots: list[int]
    next_token: torch.Tensor
    scores: torch.Tensor


def walk(
    verified: VerifiedTree,
    raw_logits: torch.Tensor,
    history: torch.Tensor,
    logits_processor: LogitsProcessorList,
    do_sample: bool,
) -> Walk:
    """Exact acceptance over a verified tree: raw target logits [1 + B, V] for its slots, the row's committed
    ``history`` [T] (ending with the anchor). From the anchor, the target's processed distribution at the current
    slot (given that slot's path) picks a token — its argmax, or a sample; if a child of the slot holds it, the walk
    moves there, else it stops and the token is the round's new one. -> :class:`Walk`."""
    slot, path, tokens, scores = 0, [], history, []
    while True:
        score = process(logits_processor, tokens[None], raw_logits[slot : slot + 1])
        scores.append(score)
        choice = torch.multinomial(probs(score)[0], 1)[0] if do_sample else score[0].argmax()
        child = verified.children.get((slot, int(choice)))
        if child is None:
            return Walk(path, choice, torch.cat(scores))
        path.append(child)
        tokens = torch.cat([tokens, choice[None]])
        slot = child
