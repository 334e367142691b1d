"""The draft's side of a round: its context cache, the target layers it reads, and the drafted block.

LayerTap      forward hooks that fuse the tapped target layers into the draft's context input as they run
DraftContext  the draft's cache of context keys/values, extended lazily by the next drafted block
draft_block   one backbone pass for all rows, then the sequential head left to right -> tokens, q, c
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field

import torch
from transformers.generation import LogitsProcessorList

from ..model.kernel_dispatch import fused_head_step, fused_temperature, use_kernels
from ..model.modeling_dspark import DSparkDraftModel
from ..scheduling.policy import ColumnPlan
from .verify import probs, process

FLUSH_CHUNK = 1024  # context positions projected per call (every position is projected on its own)


@dataclass
class DraftContext:
    """The draft's cache of projected context keys/values, one (k, v) pair per draft layer: [R, KV, L, hd].

    New fused context (the target's tapped layers through ``fc``: :class:`LayerTap`) is queued by :meth:`extend`
    and projected to keys/values by :meth:`flush`, which the next drafted block calls first: rounds that do not
    draft (back-off, length limit) project nothing, and the queued rounds are projected in one call."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    valid: torch.Tensor  # [R, L] bool: False for padding and rejected slots (flushed slots only)
    positions: torch.Tensor  # [R, L] sequence position of each flushed entry (kept for sliding-window layers only)
    pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def extend(self, fused: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """Queue new fused context [R, n, d] at positions [R, n] (valid [R, n]) for the next flush."""
        self.pending.append((fused, positions, valid))

    def flush(self, draft: DSparkDraftModel) -> None:
        """Project the queued context (only that: the cache keeps earlier projections) and append it."""
        if not self.pending:
            return
        fused, positions, valid = (
            parts[0] if len(parts) == 1 else torch.cat(parts, dim=1) for parts in zip(*self.pending, strict=True)
        )  # one queued round (the prefill, a drafted round) is used as it is: no copy of a long prompt's states
        self.pending = []
        if not bool(valid.all()):  # holes may hold garbage; keep it out of the cache
            fused = torch.where(valid[..., None], fused, 0)
        # a long prompt is projected FLUSH_CHUNK positions at a time: the projection's intermediates stay small
        chunks = [
            draft.fused_key_values(fused[:, i : i + FLUSH_CHUNK].to(draft.dtype), positions[:, i : i + FLUSH_CHUNK])
            for i in range(0, fused.shape[1], FLUSH_CHUNK)
        ]
        self.keys = [torch.cat([k, *(c[j][0] for c in chunks)], dim=2) for j, k in enumerate(self.keys)]
        self.values = [torch.cat([v, *(c[j][1] for c in chunks)], dim=2) for j, v in enumerate(self.values)]
        self.valid = torch.cat([self.valid, valid], dim=1)
        if any(draft.config.sliding_layers):  # only sliding-window layers read the positions: no copy for others
            self.positions = torch.cat([self.positions, positions], dim=1)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows ``rows`` [R'] (indices), in that order."""
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.valid = self.valid[rows]
        self.positions = self.positions[rows]
        self.pending = [tuple(x[rows] for x in queued) for queued in self.pending]

    @classmethod
    def empty(cls, draft: DSparkDraftModel, rows: int, device: torch.device) -> DraftContext:
        c = draft.config
        kv = torch.empty(rows, c.num_key_value_heads, 0, c.head_dim, device=device, dtype=draft.dtype)
        n = len(draft.layers)
        no_positions = torch.empty(rows, 0, dtype=torch.long, device=device)
        return cls([kv] * n, [kv] * n, torch.empty(rows, 0, dtype=torch.bool, device=device), no_positions)


@dataclass
class Proposal:
    """Drafted blocks for R rows: tokens [R, G], processed draft probabilities q [R, G, V] (sampling only),
    confidences c [R, G] or None. G is the largest number of tokens any row may verify this round."""

    tokens: torch.Tensor
    probs: torch.Tensor | None
    confidences: torch.Tensor | None
    planner: ColumnPlan | None = None  # the column plan that ended the block, when the schedule planned it


def layer_outputs(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> list[torch.Tensor]:
    """The outputs of target layers ``layer_ids``: ``hidden_states[l + 1]`` (entry 0 is the embedding)."""
    return [hidden_states[layer + 1] for layer in layer_ids]


def target_features(draft: DSparkDraftModel, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The target layers the draft reads, fused along features: -> [R, n, m·d_t]."""
    return torch.cat(layer_outputs(hidden_states, draft.config.target_layer_ids), dim=-1)


class LayerTap:
    """Fuses, during a target forward, the hidden states of the decoder layers the draft reads into the draft's
    context input as each layer runs: [R, n, d] (:meth:`DSparkDraftModel.fuse_context`), never [R, n, m·d_t].

    ``output_hidden_states=True`` materialises every layer's [R, T, d_t] (at a 32k-token prompt on Qwen3-8B, 37 ×
    32,768 × 4,096 × 2 B ≈ 9.9 GB); forward hooks on the ``target_layer_ids`` layers add each one's share of the
    fusion into one [R, n, d] buffer, so at most one tapped layer's states are alive beside it. Their outputs are
    ``hidden_states[l + 1]`` exactly for every layer but the last (whose entry is after the final norm), so a draft
    reading the last layer, or a model whose decoder layers are not found, falls back to ``output_hidden_states``.
    Hooks record only forwards run by the thread that made the tap, so two calls sharing a target in two threads
    do not see each other's states. Use as a context manager.
    """

    def __init__(self, target, draft: DSparkDraftModel):
        self.draft = draft
        self.layer_ids = list(draft.config.target_layer_ids)
        self.buffer: torch.Tensor | None = None  # [R, n, d], summed slot by slot as the layers run
        self.handles = []
        self.thread = threading.get_ident()
        decoder = target.get_decoder() if hasattr(target, "get_decoder") else None
        layers = getattr(decoder, "layers", None)
        n = target.config.get_text_config().num_hidden_layers
        if isinstance(layers, torch.nn.ModuleList) and len(layers) == n and max(self.layer_ids) < n - 1:
            self.handles = [layers[layer].register_forward_hook(self._hook(layer)) for layer in set(self.layer_ids)]

    @property
    def active(self) -> bool:
        return bool(self.handles)

    def _hook(self, layer: int):
        slots = [i for i, tapped in enumerate(self.layer_ids) if tapped == layer]

        def keep(module, args, output):
            if threading.get_ident() != self.thread or self.buffer is None:
                return
            hidden = output[0] if isinstance(output, tuple) else output
            for slot in slots:  # fused at once, so the layer's own output can be freed as the model goes on
                self.draft.fuse_layer_into(self.buffer, slot, hidden)

        return keep

    def expect(self, rows: int, tokens: int, device) -> None:
        """Allocate the [rows, tokens, d] buffer the next forward fills."""
        if self.active:
            shape = (rows, tokens, self.draft.config.hidden_size)
            self.buffer = torch.zeros(shape, dtype=self.draft.dtype, device=device)

    def fused(self, out) -> torch.Tensor:
        """The draft's fused context input [R, n, d] of the forward that produced ``out`` (from its hidden states
        when the tap is inactive)."""
        if not self.active:
            return self.draft.fuse_context(target_features(self.draft, out.hidden_states).to(self.draft.dtype))
        fused, self.buffer = self.buffer, None
        return fused

    def __enter__(self) -> LayerTap:
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self.buffer = [], None


def head_step(draft, logits, h_k, prev, state, conf_temperature, rows=None, kernel_temperature=None):
    """One step of the draft's heads at one slot, wherever the head steps (a chain's block, a tree's expansion): the
    sequential head's bias (from each row's previous token ``prev`` [R] and its own state) added to the slot's base
    ``logits`` [R, V] (over W2's ``rows`` when given), and the slot's calibrated confidence from h_k [R, d] and the
    head's W1 feature: -> (logits, confidences [R] or None, head state).

    ``kernel_temperature`` (set where :func:`~hf_dspark.model.kernel_dispatch.use_kernels` says the fused Triton
    step serves this call: the call's processing is at most that temperature) runs the step through the kernel,
    whose logits come divided by the temperature already; else PyTorch. A chain's sampled slot
    (:func:`_kernel_slot`) also takes the kernel's own draw."""
    if kernel_temperature is not None:
        scores, _, _, conf, state = fused_head_step(
            draft, logits, h_k, prev, state, kernel_temperature, False, conf_temperature
        )
        return scores, conf, state
    head, conf_head, feature, conf = draft.sequential_head, draft.confidence, None, None
    if head is not None:
        bias, feature, state = head.step(prev, h_k, state, rows=rows)
        if draft.head_enabled:
            logits = logits + bias
    if conf_head is not None:
        conf = conf_head.calibrated(conf_head.logit(h_k, feature), conf_temperature)
    return logits, conf, state


def _torch_slot(draft, logits, h_k, prev, state, histories, logits_processor, do_sample, conf_temperature):
    """One slot on the PyTorch path: head bias, confidence, the target's processors (per row, with that row's
    history), argmax or sample. -> (tokens [R], processed probs [R, V] or None, confidences [R] or None, state)."""
    rows = draft.head_full_rows()  # None unless W2 stores draft-vocabulary rows only
    logits, conf, state = head_step(draft, logits, h_k, prev, state, conf_temperature, rows)
    logits = logits.to(torch.float32 if logits.dtype != torch.float64 else logits.dtype)
    if logits_processor:
        logits = torch.cat([process(logits_processor, ids[None], logits[r : r + 1]) for r, ids in enumerate(histories)])
    if not do_sample:
        return logits.argmax(-1), None, conf, state
    p = probs(logits)
    return torch.multinomial(p, 1)[:, 0], p, conf, state


def _subset_slot(
    draft, logits, h_k, prev, state, histories, logits_processor, do_sample, conf_temperature, *, rows, vocab
):
    """Greedy slot over a draft vocabulary: logits [R, Vd] and the head's bias from W2's ``rows`` [Vd, r];
    the argmax column maps back to a token id through ``vocab``. Same tokens as ``_torch_slot`` on the -inf-padded
    full logits (``vocab`` is sorted, so ties resolve to the same token)."""
    logits, conf, state = head_step(draft, logits, h_k, prev, state, conf_temperature, rows)
    return vocab[logits.float().argmax(-1)], None, conf, state


def _kernel_slot(draft, logits, h_k, prev, state, histories, logits_processor, do_sample, conf_temperature):
    """The same slot through the fused Triton step (temperature is the only processing it fuses)."""
    temperature = fused_temperature(logits_processor)
    _, token, p, conf, state = fused_head_step(
        draft, logits, h_k, prev, state, temperature, do_sample, conf_temperature
    )
    return token, p, conf, state


def draft_backbone(
    draft: DSparkDraftModel,
    context: DraftContext,
    anchors: torch.Tensor,
    anchor_positions: torch.Tensor,
    compute_logits: bool = True,
):
    """The backbone's one pass for a block after each row's anchor: anchors [R] at ``anchor_positions`` [R], after
    the context (flushed first) -> ``DSparkOutput`` with base logits U [R, block, V] and h [R, block, d]."""
    R, block_size, device = anchors.shape[0], draft.config.block_size, anchor_positions.device
    context.flush(draft)
    positions = anchor_positions[:, None] + torch.arange(block_size, device=device)
    mask = None
    if not bool(context.valid.all()):
        mask = torch.cat([context.valid, torch.ones(R, block_size, dtype=torch.bool, device=device)], dim=1)
        mask = mask[:, None, :].expand(R, block_size, -1)
    context_kv = list(zip(context.keys, context.values, strict=True))
    return draft(draft.embed_block(anchors), positions, context_kv, mask, compute_logits, context.positions)


@torch.no_grad()
def draft_block(
    draft: DSparkDraftModel,
    context: DraftContext,
    histories: list[torch.Tensor],
    anchor_positions: torch.Tensor,
    max_tokens: int,
    logits_processor: LogitsProcessorList,
    do_sample: bool,
    planner: ColumnPlan | None = None,
) -> Proposal:
    """Propose ``max_tokens`` (≤ the draft's tokens per block) tokens after each row's anchor ``histories[r][-1]``
    (at ``anchor_positions``).

    One backbone forward gives U, h for all rows and slots; the sequential head then adds its bias left to right,
    each position's logits are processed exactly like the target's, and a token is chosen (argmax or sample).
    ``planner``: a :class:`ColumnPlan` that admits each slot's confidences (float64) as they come; the block ends
    (fewer than ``max_tokens`` tokens) at the first column it closes on, since no later slot would be verified.
    """
    device = anchor_positions.device
    anchors = torch.stack([h[-1] for h in histories])
    R = anchors.shape[0]
    if max_tokens == 0:
        no_conf = None if draft.confidence is None else torch.empty(R, 0, device=device)
        return Proposal(anchors.new_empty(R, 0), None, no_conf)
    step = _kernel_slot if use_kernels(draft, device, logits_processor, R) else _torch_slot
    # greedy with no logits processors and a draft vocabulary: choose tokens inside the subset, never building
    # [R, V] logits (the head's bias and the argmax then cover len(draft_vocab) columns instead of V)
    subset = step is _torch_slot and not do_sample and not logits_processor and draft.draft_vocab is not None
    out = draft_backbone(draft, context, anchors, anchor_positions, compute_logits=not subset)
    logits = draft.draft_vocab_logits(out.hidden_states) if subset else out.logits
    if subset:
        step = functools.partial(_subset_slot, rows=draft.head_vocab_rows(), vocab=draft.draft_vocab)
    temps, off = draft.config.sts_temperatures, draft.config.draft_offset
    tokens, dists, confs = [], [], []
    prev, state = anchors, None
    for k in range(max_tokens):
        hist = histories  # the processors see each row's history including this block's earlier tokens
        if logits_processor and tokens:
            so_far = torch.stack(tokens, dim=1)
            hist = [torch.cat([h, so_far[r]]) for r, h in enumerate(histories)]
        slot = k + off  # DFlash convention: the anchor slot proposes nothing
        token, p, conf, state = step(
            draft,
            logits[:, slot],
            out.hidden_states[:, slot],
            prev,
            state,
            hist,
            logits_processor,
            do_sample,
            temps[k] if temps else None,
        )
        tokens.append(token)
        if p is not None:
            dists.append(p)
        if conf is not None:
            confs.append(conf)
        prev = token
        if planner is not None and not planner.admit(conf.double()):
            break
    return Proposal(
        tokens=torch.stack(tokens, dim=1),
        probs=torch.stack(dists, dim=1) if do_sample else None,
        confidences=torch.stack(confs, dim=1).double() if confs else None,
    )
