"""Sequential heads and the confidence head (docs/method.md, "Sequential head", "Confidence head and STS").

Each sequential head adds a bias B_k to the backbone's base logits U_k that depends on the tokens already chosen
in the block. All heads share one step interface, so drafting runs them left to right without knowing which is
which:

    bias [R, V], feature [R, r], state = head.step(prev_tokens [R], h_k [R, d], state)

(``rows=W2[subset]`` gives the bias over a vocabulary subset instead, [R, len(subset)]. A head built with
``out_rows`` < V stores W2's rows for a draft vocabulary only (``DSparkConfig.head_vocab = "draft"``); its callers
then pass ``rows=`` for the whole vocabulary, see ``DSparkDraftModel.head_full_rows``.)

``feature`` is W1[x_{k-1}], the input the confidence head reads beside h_k. ``teacher_forced`` runs all γ steps
at once from known previous tokens (training, calibration), with the same ``rows=``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LowRankHead(nn.Module):
    """What every sequential head is: a low-rank code [R, r] computed from (x_{k-1}, h_k, state), and the bias
    B_k = code · W2ᵀ. Kernels and drafting read a head through this interface only: :meth:`low_rank_code`,
    :attr:`output_weight` (W2), :attr:`embedding_weight` (W1) and ``code_is_embedding``.

    ``code_is_embedding``: the code is W1[x_{k-1}] itself (the plain Markov head), so a kernel may gather it from
    :attr:`embedding_weight` and fuse the confidence head's dot product, instead of receiving it computed.
    """

    code_is_embedding = False

    def low_rank_code(self, prev: torch.Tensor, h: torch.Tensor, state=None):
        """prev [R], h [R, d], state -> (code [R, r], feature W1[x_{k-1}] [R, r], new state)."""
        raise NotImplementedError

    @property
    def output_weight(self) -> torch.Tensor:
        """W2 [rows, r]: one row per target token, or per draft-vocabulary token (``head_vocab = "draft"``)."""
        return self.markov_w2.weight

    @property
    def embedding_weight(self) -> torch.Tensor:
        """W1 [V, r]."""
        return self.markov_w1.weight

    def step(self, prev: torch.Tensor, h: torch.Tensor, state=None, rows: torch.Tensor | None = None):
        """-> bias [R, V] (or [R, len(rows)] over a vocabulary subset given as W2's rows), feature, state."""
        code, e, state = self.low_rank_code(prev, h, state)
        return (self.markov_w2(code) if rows is None else F.linear(code, rows)), e, state

    def teacher_forced(self, prev: torch.Tensor, h: torch.Tensor, rows: torch.Tensor | None = None):
        """prev [..., γ], h [..., γ, d] -> bias [..., γ, V] (or [..., γ, len(rows)]), feature [..., γ, r]: the γ
        steps from known previous tokens, left to right (a stateless head overrides this with one batched call)."""
        state, biases, feats = None, [], []
        for k in range(prev.shape[-1]):
            b, e, state = self.step(prev[..., k], h[..., k, :], state, rows)
            biases.append(b)
            feats.append(e)
        return torch.stack(biases, dim=-2), torch.stack(feats, dim=-2)


class MarkovHead(LowRankHead):
    """B(x_{k-1}, ·) = W1[x_{k-1}] · W2, with W1 ∈ R^{V×r} and W2 ∈ R^{r×V} (stored as Linear r→V)."""

    code_is_embedding = True

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, out_rows: int | None = None):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, out_rows or vocab_size, bias=False)

    def mix(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The code from W1[x_{k-1}] and h_k: W1[x_{k-1}] itself here; gated in :class:`GatedMarkovHead`."""
        return e

    def low_rank_code(self, prev: torch.Tensor, h: torch.Tensor, state=None):
        e = self.markov_w1(prev)
        return self.mix(e, h), e, state

    def teacher_forced(self, prev: torch.Tensor, h: torch.Tensor, rows: torch.Tensor | None = None):
        e = self.markov_w1(prev)
        code = self.mix(e, h)
        return (self.markov_w2(code) if rows is None else F.linear(code, rows)), e


class GatedMarkovHead(MarkovHead):
    """Markov head whose low-rank code is gated by the slot's hidden state: W1[x] ⊙ σ(W_g [h_k; W1[x]])."""

    code_is_embedding = False

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, out_rows: int | None = None):
        super().__init__(vocab_size, hidden_size, rank, out_rows)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def mix(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return e * torch.sigmoid(self.gate_proj(torch.cat([h, e], dim=-1)))


class RNNHead(LowRankHead):
    """Gated recurrent head: z_k = [s_{k-1}; W1[x_{k-1}]; h_k], s_k = g ⊙ s_{k-1} + (1-g) ⊙ tanh(W_c z_k),
    B_k = W2ᵀ tanh(W_o z_k), with g = σ(W_g z_k) and W_g, W_c, W_o one joint linear (2r + d) -> 3r; s_0 = 0.
    (W1 and W2 keep the Markov head's parameter names, ``markov_w1``/``markov_w2``: the checkpoint layouts of
    DeepSpec and speculators name them so for every head type.)"""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, out_rows: int | None = None):
        super().__init__()
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.rnn_cell = nn.Linear(2 * rank + hidden_size, 3 * rank)
        self.markov_w2 = nn.Linear(rank, out_rows or vocab_size, bias=False)

    def low_rank_code(self, prev: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None = None):
        """-> (code tanh(W_o z_k) [R, r], feature W1[x_{k-1}] [R, r], new state [R, r]); the bias is code · W2ᵀ."""
        e = self.markov_w1(prev)
        if state is None:
            state = e.new_zeros(*e.shape[:-1], self.rank)
        gate, cand, out = self.rnn_cell(torch.cat([state, e, h], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(cand)
        return torch.tanh(out), e, state


HEADS = {"markov": MarkovHead, "gated": GatedMarkovHead, "rnn": RNNHead}


def build_sequential_head(config) -> nn.Module | None:  # config: a DSparkConfig (which imports HEADS from here)
    """The sequential head named by ``config.head_type`` (``None`` for the pure parallel drafter); W2 has one row
    per draft-vocabulary token when ``config.head_vocab == "draft"``, else one per target token."""
    if config.head_type == "none":
        return None
    out_rows = config.draft_vocab_size if config.head_vocab == "draft" else None
    return HEADS[config.head_type](config.target_vocab_size, config.hidden_size, config.head_rank, out_rows)


class ConfidenceHead(nn.Module):
    """c_k = σ(wᵀ [h_k; W1[x_{k-1}]] / T_k): probability that slot k survives verification given 1..k-1 did.

    Without a sequential head (or with ``confidence_with_head=False``) the input is h_k alone. ``temperatures``
    (STS, one per position) divide the logit.
    """

    def __init__(self, hidden_size: int, feature_size: int):
        super().__init__()
        self.feature_size = feature_size  # 0: reads h_k only
        self.confidence_head = nn.Linear(hidden_size + feature_size, 1)

    def weight_and_bias(self) -> tuple[torch.Tensor, float]:
        """w [d + feature_size] and the bias, for a kernel that fuses wᵀ[h_k; W1[x_{k-1}]] into its own loop."""
        return self.confidence_head.weight[0], float(self.confidence_head.bias[0])

    def logit(self, h: torch.Tensor, feature: torch.Tensor | None) -> torch.Tensor:
        x = h if feature is None or self.feature_size == 0 else torch.cat([h, feature], dim=-1)
        return self.confidence_head(x).squeeze(-1)

    @staticmethod
    def calibrated(logit: torch.Tensor, temperature: float | torch.Tensor | None) -> torch.Tensor:
        """σ(logit / T) [R] in float32 at least: in a bfloat16 draft, σ near 1 would round to exactly 1 (spacing
        2⁻⁸), flattening the survival products the scheduler compares and losing the logit calibration reads back."""
        logit = logit.float() if logit.dtype in (torch.bfloat16, torch.float16) else logit
        return torch.sigmoid(logit if temperature is None else logit / temperature)


def soft_acceptance_label(draft_probs: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """c*_k = 1 - ½‖p_d - p_t‖₁ = Σ_v min(p_d, p_t): the exact one-step acceptance probability. [..., V] -> [...]."""
    return torch.minimum(draft_probs, target_probs).sum(-1).clamp(0, 1)
