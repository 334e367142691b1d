"""Training forward and the three DSpark losses (docs/method.md, "Training"), packed over many anchors per sequence.

For each anchor a, the block [x_a, mask, …] predicts x_{a+1..a+γ}; it sees the target's features at positions < a
(block-sparse mask) and its own γ slots bidirectionally. The sequential head is teacher-forced with the true
previous tokens. Position weights w_k = exp(-(k-1)/decay), zero past the end of the sequence.

    L = w_ce·CE + w_tv·‖p_d - p_t‖₁ + w_conf·BCE(c, 1 - ½‖p_d - p_t‖₁) + w_kd·KD + w_argmax·CE(argmax p_t),
    KD = -Σ_v p_t(v) log p_d(v)

CE fits the answer's own next token (a sample of the target when answers are regenerated at a temperature); in
a row whose text the target did not write (``target_wrote`` False: reference answers), that token is no sample of
the target, so CE fits the target's distribution there instead (-Σ_v p_t(v) log p_d(v), its expectation when the
target writes the text: one forward pass gives the labels, no regeneration). KD,
off by default, fits the target's whole next-token distribution at the same slot (distillation: the same optimum,
without the sampling noise of one drawn token). The argmax term, off by default, fits the target's most likely
token at the slot: the label greedy verification checks, which a sampled answer's token often is not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..model.modeling_dspark import DSparkDraftModel
from .features import target_statistics


@dataclass
class LossWeights:
    """Weights of the loss terms (see the module docstring)."""

    ce: float = 0.1
    tv: float = 0.9
    conf: float = 1.0
    kd: float = 0.0
    argmax: float = 0.0


def block_attention_mask(anchors: torch.Tensor, valid: torch.Tensor, gamma: int) -> torch.Tensor:
    """anchors [R, A], valid [R, L] (context positions that exist) -> mask [R, A·γ, L + A·γ] (True = may attend).

    Slot (i, k) sees context positions < anchors[i] and the γ slots of its own block, nothing else.
    """
    R, A = anchors.shape
    L = valid.shape[1]
    pos = torch.arange(L, device=anchors.device)
    ctx = (pos[None, None, :] < anchors[:, :, None]) & valid[:, None, :]  # [R, A, L]
    ctx = ctx.repeat_interleave(gamma, dim=1)  # [R, A·γ, L]
    block_id = torch.arange(A, device=anchors.device).repeat_interleave(gamma)
    own = (block_id[:, None] == block_id[None, :]).expand(R, -1, -1)
    return torch.cat([ctx, own], dim=-1)


@dataclass
class BlockPredictions:
    """Teacher-forced draft predictions for A blocks per row over C columns (the whole vocabulary, or a draft
    vocabulary): all tensors shaped [R, A, γ, ...]."""

    logits: torch.Tensor  # draft logits after the sequential head, float32 [R, A, γ, C]
    target_logprobs: torch.Tensor  # target log-probs of the same columns, normalised over the whole vocabulary
    labels: torch.Tensor  # column of the true next token, -1 when the columns lack it [R, A, γ]
    target_top: torch.Tensor  # column of the target's argmax, -1 when the columns lack it [R, A, γ]
    has_label: torch.Tensor  # False past the end of the sequence [R, A, γ]
    confidence_logits: torch.Tensor | None  # [R, A, γ]


def _head_rows(draft: DSparkDraftModel, vocab: torch.Tensor) -> torch.Tensor:
    """W2's rows for the training vocabulary ``vocab`` [Vd] -> [Vd, r], keeping their gradient."""
    w2 = draft.sequential_head.markov_w2.weight
    if draft.config.head_vocab == "full":
        return w2[vocab]
    if vocab is draft.draft_vocab:  # checked once by DSparkTrainingModule: no host sync per step
        return w2
    if draft.draft_vocab is None or not torch.equal(vocab.to(draft.draft_vocab.device), draft.draft_vocab):
        raise ValueError(
            "this draft's head stores W2 for its draft vocabulary only (head_vocab='draft'): train over that same "
            "vocabulary, or call draft.set_head_vocab('full') first"
        )
    return w2


def block_predictions(
    draft: DSparkDraftModel,
    features: torch.Tensor,
    input_ids: torch.Tensor,
    valid: torch.Tensor,
    anchors: torch.Tensor,
    target_hidden: torch.Tensor,
    vocab: torch.Tensor | None = None,
    target_stats: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> BlockPredictions:
    """features [R, L, m·d_t] (target hidden states), input_ids [R, L], valid [R, L] bool, anchors [R, A]
    (positions that have a next token), target_hidden [R, L, d_t] (the target's final normed hidden state; its LM
    head is applied only at the block slots). ``vocab`` [C], distinct token ids: predict over these columns only
    (column i is token ``vocab[i]``), as a draft with that draft vocabulary decodes (``None``: the whole
    vocabulary). ``target_stats`` (logsumexp [R, L] float32, argmax [R, L]): the target's whole-vocabulary
    log-normaliser and argmax at every position (as :class:`~.features.FeatureCache` stores them); with a ``vocab``
    they spare the whole-vocabulary LM head at every slot (without, they are computed here).
    """
    if draft.config.draft_offset != 0:
        raise ValueError("training supports DSpark's block convention only (draft_offset=0)")
    gamma = draft.config.block_size
    R, L = input_ids.shape
    A = anchors.shape[1]
    k = torch.arange(gamma, device=input_ids.device)
    slot_pos = anchors[:, :, None] + k  # [R, A, γ]: slot k sits at position a + k and predicts a + k + 1
    label_pos = slot_pos + 1
    gather = lambda t, idx: torch.gather(t, 1, idx.clamp_max(L - 1).reshape(R, -1)).view(R, A, gamma)  # noqa: E731
    labels = gather(input_ids, label_pos)
    has_label = (label_pos < L) & gather(valid.long(), label_pos).bool()
    prev = gather(input_ids, slot_pos)  # x_{a+k}: the anchor, then the teacher-forced tokens

    positions = torch.arange(L, device=input_ids.device).expand(R, L)
    context = draft.context_key_values(features.to(draft.dtype), positions)
    embeds = draft.embed_block(input_ids.gather(1, anchors)).reshape(R, A * gamma, -1)
    mask = block_attention_mask(anchors, valid, gamma)
    out = draft(embeds, slot_pos.reshape(R, -1), context, mask, False, positions)
    h = out.hidden_states.view(R, A, gamma, -1)
    if vocab is None:
        logits, rows = draft.lm_head(h).float(), None
    else:
        # the frozen LM head's rows are gathered per call; W2's rows keep their gradient
        head = draft.target.get_output_embeddings()
        head_rows = head.weight[vocab]
        head_bias = head.bias[vocab] if getattr(head, "bias", None) is not None else None
        logits = F.linear(h, head_rows, head_bias).float()
        rows = None if draft.sequential_head is None else _head_rows(draft, vocab)
    feature = None
    if draft.sequential_head is not None:
        bias, feature = draft.sequential_head.teacher_forced(prev, h, rows)
        logits = logits + bias.float()
    d = target_hidden.shape[-1]
    t_hidden = torch.gather(target_hidden, 1, slot_pos.clamp_max(L - 1).reshape(R, -1, 1).expand(-1, -1, d))
    t_hidden = t_hidden.to(draft.dtype).view(R, A, gamma, d)
    with torch.no_grad():
        if vocab is None:
            t_logp = F.log_softmax(draft.lm_head(t_hidden).float(), -1)
            t_top = t_logp.argmax(-1)
        else:  # normalised over the whole vocabulary, computed for the subset's columns only
            if target_stats is None:
                lse, top = target_statistics(draft.lm_head, t_hidden)
            else:
                lse, top = (gather(s, slot_pos) for s in target_stats)
            t_logp = F.linear(t_hidden, head_rows, head_bias).float() - lse[..., None]
            column = torch.full((draft.config.target_vocab_size,), -1, dtype=torch.long, device=vocab.device)
            column[vocab] = torch.arange(vocab.numel(), device=vocab.device)
            t_top, labels = column[top], column[labels]
    conf = draft.confidence.logit(h, feature).float() if draft.confidence is not None else None
    return BlockPredictions(logits, t_logp, labels, t_top, has_label, conf)


class DSparkTrainingModule(nn.Module):
    """Wraps a draft so one ``forward`` computes all losses (what DDP/FSDP wrap and call).

    ``vocab`` (sorted distinct token ids) trains the draft as it will decode with that draft vocabulary: its
    softmax runs over those columns only (several times cheaper per step with a ~7k-token subset of a 49k
    vocabulary), CE skips labels outside them and TV counts the target mass outside them as lost.
    """

    def __init__(self, draft: DSparkDraftModel, weights: LossWeights | None = None, vocab=None):
        super().__init__()
        draft.target.requires_grad_(False)  # the target, its embedding and LM head stay frozen
        self.draft = draft
        self.weights = weights or LossWeights()
        if vocab is not None:
            vocab = torch.as_tensor(vocab, dtype=torch.long).flatten()
            V = draft.config.target_vocab_size
            if (
                vocab.numel() == 0
                or vocab.unique().numel() != vocab.numel()
                or not (0 <= vocab.min() <= vocab.max() < V)
            ):
                raise ValueError(f"training vocab must be distinct token ids in [0, {V}), got {vocab.numel()} ids")
            vocab = vocab.sort().values
        self.register_buffer("vocab", vocab, persistent=False)
        self._same_as_draft: bool | None = None  # whether vocab is the draft's own draft vocabulary (checked once)

    def forward(
        self, features, input_ids, valid, anchors, target_hidden, target_stats=None, target_wrote=None
    ) -> dict[str, torch.Tensor]:
        """Arguments as :func:`block_predictions`; ``target_wrote`` [R] bool (default: every row) says which rows'
        text the target wrote (see :func:`block_losses`). Returns the weighted ``loss``, its components, and
        per-position acceptance estimates ``accept`` [γ] (mean soft label) and ``greedy_accept`` [γ] (argmaxes
        agree)."""
        vocab = self.vocab
        if vocab is not None and self.draft.draft_vocab is not None and vocab.shape == self.draft.draft_vocab.shape:
            if self._same_as_draft is None:  # once: torch.equal reads the device, a host sync every step otherwise
                self._same_as_draft = torch.equal(vocab, self.draft.draft_vocab.to(vocab.device))
            vocab = self.draft.draft_vocab if self._same_as_draft else vocab
        pred = block_predictions(self.draft, features, input_ids, valid, anchors, target_hidden, vocab, target_stats)
        decay = self.draft.config.loss_decay or self.draft.config.block_size
        return block_losses(pred, self.weights, decay, target_wrote)


def block_losses(
    pred: BlockPredictions, weights: LossWeights, decay: float, target_wrote: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The weighted ``loss`` of :class:`BlockPredictions`, its components, and per-position acceptance estimates
    ``accept`` [γ] (mean soft label) and ``greedy_accept`` [γ] (argmaxes agree). Position weights
    w_k = exp(-k / decay), zero where a slot has no label. ``target_wrote`` [R] bool (``None``: all True): in the
    rows where it is False, CE's label is the target's distribution, not the text's token."""
    gamma = pred.logits.shape[2]
    logp_d = F.log_softmax(pred.logits, -1)
    p_d, p_t = logp_d.exp(), pred.target_logprobs.exp()
    k = torch.arange(gamma, device=pred.logits.device)
    w = torch.exp(-k.float() / decay) * pred.has_label  # [R, A, γ]
    norm = w.sum().clamp_min(1e-6)
    w_ce = w * (pred.labels >= 0)  # a label outside the columns cannot be drafted: no CE term
    nll = -logp_d.gather(-1, pred.labels.clamp_min(0)[..., None]).squeeze(-1)
    # -Σ p_t log p_d over the columns (the target's mass outside them has no column): KD's term, and CE's where the
    # target did not write the text
    soft_nll = -(p_t * logp_d).sum(-1) if weights.kd or target_wrote is not None else None
    if target_wrote is not None:
        own = target_wrote[:, None, None]
        nll = torch.where(own, nll, soft_nll)
        w_ce = torch.where(own, w_ce, w)
    ce = (nll * w_ce).sum() / w_ce.sum().clamp_min(1e-6)
    missed = (1 - p_t.sum(-1)).clamp_min(0)  # target mass outside the columns (0 with the whole vocabulary)
    # ‖p_d - p_t‖₁ over the whole vocabulary (p_d is 0 outside the columns), whose half is 1 - Σ min(p_d, p_t):
    # the soft label c* (heads.soft_acceptance_label) without a second pass over the columns
    l1 = (p_d - p_t).abs().sum(-1) + missed
    tv = (l1 * w).sum() / norm
    soft = (1 - 0.5 * l1).clamp(0, 1).detach()
    losses = {"ce": ce, "tv": tv}
    loss = weights.ce * ce + weights.tv * tv
    if weights.kd:
        losses["kd"] = (soft_nll * w).sum() / norm
        loss = loss + weights.kd * losses["kd"]
    if weights.argmax:
        w_top = w * (pred.target_top >= 0)  # a target argmax outside the columns cannot be drafted
        nll_top = -logp_d.gather(-1, pred.target_top.clamp_min(0)[..., None]).squeeze(-1)
        losses["argmax"] = (nll_top * w_top).sum() / w_top.sum().clamp_min(1e-6)
        loss = loss + weights.argmax * losses["argmax"]
    if pred.confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(pred.confidence_logits, soft, reduction="none")
        losses["conf"] = (bce * w).sum() / norm
        loss = loss + weights.conf * losses["conf"]
    greedy = (pred.logits.argmax(-1) == pred.target_top).float()
    per_pos = pred.has_label.float().sum((0, 1)).clamp_min(1)
    return {
        "loss": loss,
        **losses,
        "accept": ((soft * pred.has_label).sum((0, 1)) / per_pos).detach(),
        "greedy_accept": ((greedy * pred.has_label).sum((0, 1)) / per_pos).detach(),
    }
