"""The draft vocabulary: a subset of the target's tokens the draft proposes from (its LM head and, optionally, the
sequential head's W2 read only those rows), and the rows it gathers once and reuses. A mixin of
:class:`~hf_dspark.model.modeling_dspark.DSparkDraftModel`, which holds the buffers and heads it reads
(``draft_vocab``, ``sequential_head``, ``borrowed``, ``config``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DraftVocabulary:
    """Setting, reading and caching the draft vocabulary (see the module)."""

    def set_draft_vocab(self, token_ids: torch.Tensor | list[int] | None) -> DraftVocabulary:
        """Restrict proposals to ``token_ids`` (1-D, distinct target token ids; ``None``: the whole vocabulary).

        Only the draft's LM head changes: it reads ``len(token_ids)`` rows, and every other token gets logit -inf,
        so the draft never proposes it. Verification still uses the target's full distribution, so decoding stays
        lossless; what changes is speed (a smaller head) and how often a token outside the subset costs a
        rejection. Training uses the whole vocabulary unless given the same ids (``train(..., vocab=)``).
        A head storing W2 for the draft vocabulary only (``head_vocab="draft"``) keeps the rows of the tokens in
        both vocabularies, starts new tokens at zero and, with ``None``, goes back to the whole vocabulary.
        Returns ``self``.
        """
        compact = self.config.head_vocab == "draft" and self.sequential_head is not None
        full_w2 = self._full_head_weight() if compact else None
        if token_ids is None:
            self._buffers.pop("draft_vocab", None)
            self.draft_vocab, self.config.draft_vocab_size = None, None
            self._vocab_rows = None
            if compact:
                self._set_head_weight(full_w2)
            self.config.head_vocab = "full"
            return self
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        V = self.config.target_vocab_size
        if ids.numel() == 0:
            raise ValueError("set_draft_vocab needs at least one token id (or None for the whole vocabulary)")
        if int(ids.min()) < 0 or int(ids.max()) >= V:
            raise ValueError(f"draft vocabulary ids must lie in [0, {V}), got {int(ids.min())}..{int(ids.max())}")
        if ids.unique().numel() != ids.numel():
            raise ValueError("draft vocabulary ids must be distinct")
        ids = ids.sort().values.to(self.device)
        self._buffers.pop("draft_vocab", None)
        self.__dict__.pop("draft_vocab", None)
        self.register_buffer("draft_vocab", ids)
        self.config.draft_vocab_size = ids.numel()
        self._vocab_rows = None
        if compact:
            self._set_head_weight(full_w2[ids])
        return self

    def set_head_vocab(self, rows: str) -> DraftVocabulary:
        """Store the sequential head's output matrix W2 with one row per target token (``"full"``) or per
        draft-vocabulary token (``"draft"``, needs a draft vocabulary): [V, r] <-> [len(draft_vocab), r]. Proposals
        are unchanged (a draft vocabulary never reads the other rows); ``"draft"`` makes the checkpoint smaller by
        (V - len(draft_vocab)) × r parameters. Rows dropped by ``"draft"`` come back as zeros. Returns ``self``."""
        if rows not in ("full", "draft"):
            raise ValueError(f"set_head_vocab takes 'full' or 'draft', got {rows!r}")
        if rows == "draft" and self.draft_vocab is None:
            raise ValueError("set_head_vocab('draft') needs a draft vocabulary: call set_draft_vocab(ids) first")
        if rows == self.config.head_vocab:
            return self
        if self.sequential_head is not None:
            full = self._full_head_weight()
            self._set_head_weight(full if rows == "full" else full[self.draft_vocab])
        self.config.head_vocab = rows
        return self

    def _full_head_weight(self) -> torch.Tensor:
        """W2 over the whole vocabulary, [V, r] (a draft-vocabulary W2 scattered into zeros)."""
        w2 = self.sequential_head.markov_w2.weight.detach()
        if self.config.head_vocab == "full":
            return w2
        full = w2.new_zeros(self.config.target_vocab_size, w2.shape[1])
        return full.index_copy_(0, self.draft_vocab.to(w2.device), w2)

    def _set_head_weight(self, weight: torch.Tensor) -> None:
        linear = self.sequential_head.markov_w2
        linear.weight = nn.Parameter(weight.contiguous(), requires_grad=linear.weight.requires_grad)
        linear.out_features = weight.shape[0]
        self._vocab_rows = None

    def _cached(self, name: str, weight: torch.Tensor, build):
        """``build()``, computed once and reused until ``weight`` or the draft vocabulary changes (keyed by
        identity, version and storage; any vocabulary, head or target change also clears the cache)."""
        key = (id(weight), weight._version, weight.data_ptr(), self.draft_vocab.data_ptr())
        cached = self._vocab_rows.get(name) if self._vocab_rows else None
        if cached is None or cached[0] != key:
            cached = (key, build())
            self._vocab_rows = {**(self._vocab_rows or {}), name: cached}
        return cached[1]

    def _subset_rows(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None):
        """``weight[draft_vocab]`` and ``bias[draft_vocab]`` (or ``None``), gathered once (see :meth:`_cached`)."""
        return self._cached(
            name,
            weight,
            lambda: (weight[self.draft_vocab].contiguous(), None if bias is None else bias[self.draft_vocab]),
        )

    def draft_vocab_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., d] -> base logits over the draft vocabulary only, [..., len(draft_vocab)] (column i is token
        ``draft_vocab[i]``). Needs a draft vocabulary."""
        head = self.borrowed.lm_head
        weight, bias = self._subset_rows("lm_head", head.weight, getattr(head, "bias", None))
        return F.linear(h.to(weight.dtype), weight, bias)

    def head_vocab_rows(self) -> torch.Tensor | None:
        """The sequential head's output matrix W2 restricted to the draft vocabulary, [len(draft_vocab), r]
        (``None`` without a draft vocabulary or a sequential head): the bias over the subset is code @ rowsᵀ."""
        if self.draft_vocab is None or self.sequential_head is None:
            return None
        if self.config.head_vocab == "draft":
            return self.sequential_head.markov_w2.weight
        return self._subset_rows("markov_w2", self.sequential_head.markov_w2.weight, None)[0]

    def head_full_rows(self) -> torch.Tensor | None:
        """W2 over the whole vocabulary, [V, r], for a head that stores draft-vocabulary rows only (the rows of
        other tokens are zero: their base logits are -inf anyway); ``None`` when the head's own W2 already covers
        the whole vocabulary (or there is no head). Built once and reused until the weight changes."""
        if self.sequential_head is None or self.config.head_vocab == "full":
            return None
        return self._cached("full_w2", self.sequential_head.markov_w2.weight, self._full_head_weight)
