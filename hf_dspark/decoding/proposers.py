"""Proposers: where a round's candidates come from, for chains and trees alike. Each proposer adds its
continuations to every row's candidates (a :class:`~hf_dspark.decoding.tree.TokenTree`, or a
:class:`ChainCandidate` for chain rounds) through one method,

    proposer.propose(candidates, requests)

and :func:`propose` runs a round's proposers in order (a tree merges what they add: shared prefixes become one
node), so one verify covers all of them. Adding a proposer is one class here and a line where a round lists its
proposers (``tree_proposers`` below, ``ChainRounds``).

    DraftBlockProposer  one drafted block for the batch (the draft's chain), ended where the schedule's plan closes
    DraftTreeProposer   one backbone pass of the draft, then the sequential head expanded node by node
    LookupProposer      (lookup.py) what followed the last earlier occurrence of the row's recent tokens
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers.generation import LogitsProcessorList

from ..model.kernel_dispatch import fused_temperature, use_kernels
from ..model.modeling_dspark import DSparkDraftModel
from ..scheduling.policy import ColumnPlan
from ..scheduling.recalibration import AcceptanceRecalibration
from .drafting import DraftContext, Proposal, draft_backbone, draft_block, head_step
from .lookup import LookupProposer, one_hot_probs
from .tree import TokenTree
from .verify import process


@dataclass
class ChainCandidate:
    """A row's candidates in a chain round: a tree of width one. Either a proposer's continuation (``tokens`` [k],
    set by :meth:`add_continuation`; ``source`` names the proposer, e.g. ``"lookup"``), or its row of the batch's
    drafted ``block`` (a :class:`~hf_dspark.decoding.drafting.Proposal`, shared by the rows), of which it may verify
    ``cap`` tokens. Once the schedule chose the row's length, :meth:`settle` keeps what the row verifies: ``tokens``
    [ℓ] (on their device), their q ``probs`` [ℓ, V] (sampling; one-hot for a continuation's deterministic tokens) and
    the draft's ``confidences`` (ℓ floats; None for a continuation, which neither the recalibration nor the stats
    count as drafted)."""

    tokens: torch.Tensor | None = None
    source: str | None = None  # the proposer of a continuation (None: the row verifies its drafted block)
    block: Proposal | None = None
    cap: int = 0
    probs: torch.Tensor | None = None
    confidences: list[float] | None = None

    def __len__(self) -> int:
        return 0 if self.tokens is None else self.tokens.shape[0]

    @property
    def looked_up(self) -> bool:
        return self.source == "lookup"

    def add_continuation(self, tokens: torch.Tensor, edge: float, source: str) -> None:
        """A proposer's continuation ``tokens`` [k] (a chain holds one: the first proposer's; ``edge`` is for trees)."""
        if self.tokens is None:
            self.tokens, self.source = tokens, source

    def settle(
        self, row: int, length: int, confidences: list[list[float]] | None, vocab_size: int, sample: bool
    ) -> None:
        """Keep the ``length`` tokens batch row ``row`` verifies (a continuation: its first ``length``, all of it
        within the row's room); ``confidences``: the block's [R][ℓ], on the host (one transfer for the batch)."""
        if self.source is not None:  # a deterministic proposal: q is one-hot (greedy needs no q)
            self.tokens = self.tokens[:length]
            self.probs = one_hot_probs(self.tokens, vocab_size) if sample else None
            return
        block, r = self.block, row
        self.tokens = block.tokens[r, :length]
        self.probs = block.probs[r, :length] if block.probs is not None else None
        self.confidences = None if confidences is None else confidences[r][:length]


@dataclass
class RowRequest:
    """What a round asks of the proposers for one row: the row's index ``row`` in the batch (and in the draft's
    context), its ``history`` [T] (committed tokens, the anchor last), the anchor's position, the deepest node a
    drafting proposer may add (``max_depth``: the room left before ``max_length``, within the draft's block), the
    node budget the round may verify, and the call's logits processors. ``lookup_depth``: the deepest a looked-up
    continuation may go (None: ``max_depth``; a chain round's lookups have their own width, and none in a batch).
    Two early stops the schedule may give the drafting proposers: ``settled(tree, bound, depth)`` says whether the
    round's choice from a row's ``tree`` is already final (no node still to come, each worth at most ``bound`` and
    deeper than ``depth``, could change it); ``plan(caps)`` is a chain round's column plan over the batch's caps
    [R] (the drafted block may end where it closes)."""

    row: int
    history: torch.Tensor
    anchor_position: torch.Tensor
    max_depth: int
    budget: int
    logits_processor: LogitsProcessorList
    draft: bool = True  # False in rounds the schedule backs off from drafting
    top_k: int | None = None  # children per node this round (None: the proposer's own; 1: the schedule narrowed)
    sample: bool = False  # the call samples: a node of width one draws its child from q
    settled: Callable[[TokenTree, float, int], bool] | None = None
    lookup_depth: int | None = None
    plan: Callable[[list[int]], ColumnPlan | None] | None = None


class Proposer(Protocol):
    def propose(self, candidates: list, requests: list[RowRequest]) -> None:
        """Add this proposer's candidates for ``requests[i]``'s row to ``candidates[i]`` (a token tree, or a chain
        candidate: each has ``len`` and ``add_continuation(tokens, edge, source)``)."""


@dataclass
class DraftBlockProposer:
    """The draft's chain for a chain round: one drafted block for the whole batch
    (:func:`~hf_dspark.decoding.drafting.draft_block`: one backbone pass, the head slot by slot), each row capped at
    its request's ``max_depth`` (0 when it does not draft this round or an earlier proposer filled it). The block
    ends at the first slot where the schedule's column plan (``RowRequest.plan``) closes. A chain round's requests
    cover every batch row (a finished row's room is 0), so the block keeps one row per batch row."""

    draft: DSparkDraftModel
    context: DraftContext

    @torch.no_grad()
    def propose(self, candidates: list[ChainCandidate], requests: list[RowRequest]) -> None:
        caps = [r.max_depth if r.draft and not len(c) else 0 for c, r in zip(candidates, requests, strict=True)]
        first = requests[0]
        planner = first.plan(caps) if first.plan is not None else None
        histories = [request.history for request in requests]
        positions = torch.stack([request.anchor_position for request in requests])
        block = draft_block(self.draft, self.context, histories, positions, max(caps), first.logits_processor,
                            first.sample, planner)  # fmt: skip
        block.planner = planner
        for candidate, cap in zip(candidates, caps, strict=True):
            candidate.block, candidate.cap = block, cap


TREE_BEAM = 4  # parents expanded per depth at most: 8 did not raise τ over 4 at 32 nodes, and doubles the head steps


@dataclass
class DraftTreeProposer:
    """The draft's tree: one backbone pass gives every slot's base logits U_k and hidden state h_k; the sequential
    head, which is the only part that depends on the tokens already in the block, is then evaluated once per
    expanded node (its own previous token, its own RNN state), so children of any node cost one low-rank head step.

    At depth k the ``beam`` (default: ``top_k``, at most ``TREE_BEAM``) most valuable nodes of depth k - 1 are
    expanded into their ``top_k`` most likely tokens (under the draft's processed distribution q), of which the
    round's ``budget`` most valuable enter the tree. A child's edge value is the confidence head's c_k for
    the parent's top child (the probability that the target keeps the draft's choice) and
    (1 - c_k) · q(x) / (1 - q(top)) for the others (the rest of the mass, shared as the draft shares it); without
    a confidence head, q(x). With ``recalibration`` (scheduled trees), c_k is first shifted toward the acceptance
    of the draft's top choices observed in the call so far, as chains shift theirs. Expansion stops early once
    ``budget`` nodes are already worth more than any node still to come (values only fall along paths), or once
    the request's ``settled`` says the schedule's choice can no longer change (the scheduler's early stop fell on a
    node worth more than any deeper one could be). A request's ``top_k`` narrows its row's children per node
    (1: the draft's chain, at a chain's cost).
    ``only_empty``: draft only the rows whose tree an earlier proposer left empty."""

    draft: DSparkDraftModel
    context: DraftContext
    top_k: int
    beam: int | None = None
    recalibration: AcceptanceRecalibration | None = None  # shifts c_k toward the call's observed acceptance
    only_empty: bool = False

    @torch.no_grad()
    def propose(self, trees: list[TokenTree], requests: list[RowRequest]) -> None:
        drafting = [
            i
            for i, request in enumerate(requests)
            if request.draft and request.max_depth > 0 and not (self.only_empty and len(trees[i]))
        ]
        if not drafting:
            return
        draft, context = self.draft, self.context
        # one backbone pass for the whole batch (the context has a row for every batch row, generating or not; rows
        # that do not draft this round get a placeholder anchor, and their block is not read)
        rows = context.valid.shape[0]
        anchors = torch.zeros(rows, dtype=torch.long, device=context.valid.device)
        positions = torch.zeros_like(anchors)
        for i in drafting:
            anchors[requests[i].row] = requests[i].history[-1]
            positions[requests[i].row] = requests[i].anchor_position
        # the fused Triton step where it serves the call (as for chains), else PyTorch; on the PyTorch path without
        # processors and with a draft vocabulary, children are chosen inside it: the LM head and the head's bias
        # cover len(draft_vocab) columns, not V (the processors, and the kernel, need the whole vocabulary)
        processors = requests[0].logits_processor
        kernel = use_kernels(draft, anchors.device, processors, len(drafting))
        subset = not kernel and not processors and draft.draft_vocab is not None
        out = draft_backbone(draft, context, anchors, positions, not subset)
        rows = torch.tensor([requests[i].row for i in drafting], device=anchors.device)
        hidden = out.hidden_states[rows]
        logits = draft.draft_vocab_logits(hidden) if subset else out.logits[rows]
        self.expand([trees[i] for i in drafting], [requests[i] for i in drafting], hidden, logits, subset,
                    fused_temperature(processors) if kernel else None)  # fmt: skip

    def expand(
        self,
        trees: list[TokenTree],
        requests: list[RowRequest],
        hidden: torch.Tensor,
        logits: torch.Tensor,
        subset: bool,
        kernel_temperature: float | None = None,
    ) -> None:
        """Grow each request's tree from its row's backbone block: ``hidden`` [n, block, d], base ``logits``
        [n, block, V] (or [n, block, len(draft_vocab)] when ``subset``), one row per request, level by level
        through the sequential head (:func:`~hf_dspark.decoding.drafting.head_step`: through the fused kernel with
        ``kernel_temperature``, which then is the call's whole processing). Every row's frontier goes through the
        head together, one depth at a time (a batch pays the head's small operations once a depth, not once a row a
        depth); each row's choice of children and its stops are its own."""
        draft = self.draft
        conf_head = draft.confidence
        w2_rows = draft.head_vocab_rows() if subset else draft.head_full_rows()
        temps, offset = draft.config.sts_temperatures, draft.config.draft_offset
        beam = self.beam or min(self.top_k, TREE_BEAM)
        depths = [min(request.max_depth, draft.config.num_draft_tokens) for request in requests]
        # each growing row's frontier (nodes to expand, -1 the root) and those nodes' paths' token ids from the
        # anchor on (host-side lists); the head's state has one row per frontier node, the growing rows' in order
        growing = {i: ([-1], [[int(request.history[-1])]]) for i, request in enumerate(requests) if depths[i] > 0}
        device = hidden.device
        state = None
        for k in range(max(depths, default=0)):
            if not growing:
                break
            owners = [i for i, (frontier, _) in growing.items() for _ in frontier]
            paths = [path for _, row_paths in growing.values() for path in row_paths]
            owner = torch.tensor(owners, device=device)
            slot = k + offset
            prev = torch.tensor([p[-1] for p in paths], device=device)
            h_k = hidden[owner, slot]
            temperature = temps[k] if temps else None
            step, conf, state = head_step(
                draft, logits[owner, slot], h_k, prev, state, temperature, w2_rows, kernel_temperature
            )
            step = step.to(torch.float32 if step.dtype != torch.float64 else step.dtype)
            if requests[0].logits_processor and kernel_temperature is None:  # the processors, on each node's path
                histories = [
                    torch.cat([requests[i].history, torch.tensor(p[1:], dtype=torch.long, device=device)])[None]
                    for i, p in zip(owners, paths, strict=True)
                ]
                step = torch.cat([
                    process(requests[i].logits_processor, history, step[j : j + 1])
                    for j, (i, history) in enumerate(zip(owners, histories, strict=True))
                ])  # fmt: skip
            q = torch.softmax(step, dim=-1)
            widest = max(min(self.top_k, requests[i].top_k or self.top_k) for i in growing)
            q_top, x_top = q.topk(min(widest, q.shape[-1]), dim=-1)
            drawn = self.draw(q, q_top, x_top, [requests[i] for i in owners]) if requests[0].sample else {}
            if subset:
                x_top = draft.draft_vocab[x_top]
                drawn = {j: q.new_zeros(draft.config.vocab_size).index_copy_(0, draft.draft_vocab, q_j)
                         for j, q_j in drawn.items()}  # fmt: skip
            edges = q_top.double()
            if conf is not None:
                raw = conf.double()
                c = raw if self.recalibration is None else self.recalibration.apply(raw, start=k)
                rest = (1 - edges[:, :1]).clamp_min(1e-12)
                edges = torch.cat([c[:, None], (1 - c[:, None]) * (edges[:, 1:] / rest).clamp(max=1)], dim=1)
            # one transfer (one sync on a GPU) a depth for the whole batch: the trees are host-side bookkeeping;
            # token ids are exact in float64
            width = x_top.shape[1]
            parts = [edges, x_top.double()] + ([] if conf_head is None else [raw[:, None]])
            host = torch.cat(parts, dim=1).cpu()
            tokens, edge_rows = host[:, width : 2 * width].long().tolist(), host[:, :width]
            raws = host[:, -1].tolist() if conf_head is not None else None
            following, keep, start = {}, [], 0
            for i, (frontier, row_paths) in growing.items():
                tree, request, stop = trees[i], requests[i], start + len(frontier)
                row_drawn = {j - start: q_j for j, q_j in drawn.items() if start <= j < stop}
                kept = self.grow(tree, request, frontier, edge_rows[start:stop], tokens[start:stop],
                                 raws[start:stop] if raws is not None else None, beam, k, row_drawn)  # fmt: skip
                if kept and depths[i] > k + 1:
                    following[i] = (
                        [node for node, _, _ in kept],
                        [[*row_paths[a], tokens[start + a][b]] for _, a, b in kept],
                    )
                    keep += [start + a for _, a, _ in kept]
                start = stop
            growing = following
            if state is not None and growing:
                state = state[torch.tensor(keep, device=device)]

    def draw(
        self, q: torch.Tensor, q_top: torch.Tensor, x_top: torch.Tensor, requests: list[RowRequest]
    ) -> dict[int, torch.Tensor]:
        """Where the call samples, a frontier node of width one (a tree narrowed to the chain) has its one child
        drawn from the draft's q, as a chain's token is, rather than the top child: acceptance then tests it against
        q (:func:`~hf_dspark.decoding.verify.walk`), which keeps Σ min(p, q) of the target's mass instead of
        p(top). Writes the draws into column 0 of ``x_top``/``q_top`` [F, K] (``q`` [F, V'], ``requests`` each
        frontier node's). -> {frontier index: its q}."""
        rows = [j for j, r in enumerate(requests) if r.sample and min(self.top_k, r.top_k or self.top_k) == 1]
        if not rows:
            return {}
        index = torch.tensor(rows, device=q.device)
        x = torch.multinomial(q[index], 1)[:, 0]
        x_top[index, 0], q_top[index, 0] = x, q[index, x]
        return {j: q[j] for j in rows}

    def grow(
        self,
        tree: TokenTree,
        request: RowRequest,
        frontier: list[int],
        edges: torch.Tensor,
        tokens: list[list[int]],
        raws: list[float] | None,
        beam: int,
        k: int,
        drawn: dict[int, torch.Tensor] | None = None,
    ) -> list[tuple[int, int, int]]:
        """One row's depth k + 1: of its ``frontier`` nodes' children (``edges`` [F, K] float64 edge values,
        ``tokens`` their ids, ``raws`` the confidence of each parent's top child, ``drawn`` the q [V] of each
        frontier node whose one child was sampled from it), the ``budget`` most valuable enter ``tree``. -> the
        children to expand next, best first: (node, parent's index in ``frontier``, child's index), none when the
        row stops here."""
        drawn = drawn or {}
        width = min(edges.shape[1], request.top_k or edges.shape[1])
        edges, tokens = edges[:, :width], [row[:width] for row in tokens]
        bases = torch.tensor([1.0 if p < 0 else tree.values[p] for p in frontier], dtype=torch.float64)
        values = (bases[:, None] * edges).flatten()
        # only this depth's `budget` most valuable children can enter the round's best `budget` nodes (each child
        # below them has `budget` better nodes of its own depth, and their ancestors, ahead of it)
        best = values.topk(min(values.numel(), request.budget)).indices.tolist()
        edge_list, children = edges.tolist(), []
        for flat in best:
            i, j = divmod(flat, width)
            node = tree.add(frontier[i], tokens[i][j], edge_list[i][j], "draft", top=j == 0, probs=drawn.get(i))
            if j == 0 and raws is not None:
                tree.confidences[node] = raws[i]
            children.append((tree.values[node], node, i, j))
        kept = [c for c in children[:beam] if c[0] > 0]
        ranked = sorted(tree.values, reverse=True)
        if not kept or (len(ranked) >= request.budget and ranked[request.budget - 1] >= kept[0][0]):
            return []  # no deeper node could enter the round's best `budget`
        if request.settled is not None and request.settled(tree, kept[0][0], k + 1):
            return []  # the schedule stops inside what is here: a deeper node cannot change its choice
        return [(node, i, j) for _, node, i, j in kept]


def propose(proposers: list[Proposer], requests: list[RowRequest], empty: Callable[[], object] = TokenTree) -> list:
    """One candidate set per request (``empty()``: a :class:`TokenTree`, or a :class:`ChainCandidate` for chain
    rounds) with every proposer's candidates for its row, in the proposers' order (a tree merges shared prefixes)."""
    candidates = [empty() for _ in requests]
    for proposer in proposers:
        proposer.propose(candidates, requests)
    return candidates


def tree_proposers(draft, settings, recalibration=None) -> list[Proposer]:
    """The proposers one call's trees merge, from its settings (a ``DecodingConfig``): the draft's branches, and
    lookup continuations when ``lookup_max_ngram`` > 0 (first, and then the draft skips the rows they filled,
    unless ``tree_lookup_merge``). ``recalibration``: the draft proposer's confidence shift, fed by the schedule
    from each walk. A new proposer is a class above and a line here."""
    merge = settings.tree_lookup_merge or settings.lookup_max_ngram == 0
    drafter = DraftTreeProposer(draft, None, settings.tree_top_k, recalibration=recalibration, only_empty=not merge)
    lookup = LookupProposer.of(settings, draft.config.num_draft_tokens)
    if lookup is None:
        return [drafter]
    return [drafter, lookup] if merge else [lookup, drafter]
