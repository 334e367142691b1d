"""Exact verification of a drafted block (docs/method.md, "Verification").

Greedy: accept while the draft token equals the target's argmax. Sampling: accept x_k with probability
min(1, p_k(x_k) / q_k(x_k)); at the first rejection resample from norm(max(0, p_k - q_k)); if every token survives,
draw a bonus token from p_{ℓ+1}. Both p and q are the *processed* distributions (temperature, top-k, top-p, …),
so the committed tokens follow the target's processed distribution exactly.
"""

from __future__ import annotations

import torch
from transformers.generation import LogitsProcessorList


def probs(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, in float32 for half-precision scores (float64 stays float64)."""
    return torch.softmax(scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores, dim=-1)


def process(logits_processor: LogitsProcessorList, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Apply the target's logits processors to one position of one row: ids [1, T] (its history), scores [1, V]."""
    return logits_processor(ids, scores) if logits_processor else scores


def greedy_accept(draft_tokens: torch.Tensor, target_scores: torch.Tensor) -> tuple[int, torch.Tensor]:
    """draft_tokens [ℓ], target_scores [ℓ+1, V] -> (n accepted, next token as a 0-d tensor)."""
    choice = target_scores.argmax(-1)
    n = int((draft_tokens == choice[: draft_tokens.shape[0]]).long().cumprod(0).sum())
    return n, choice[n]


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, torch.Tensor]:
    """draft_tokens [ℓ], draft_probs q [ℓ, V], target_probs p [ℓ+1, V] -> (n accepted, next token).

    The next token is the residual sample at the first rejection, or the bonus sample when all ℓ survive.
    """
    ell = draft_tokens.shape[0]
    if ell == 0:
        return 0, torch.multinomial(target_probs[0], 1, generator=generator)[0]
    idx = torch.arange(ell, device=draft_tokens.device)
    p_x = target_probs[idx, draft_tokens]
    q_x = draft_probs[idx, draft_tokens]
    u = torch.rand(ell, device=p_x.device, dtype=p_x.dtype, generator=generator)
    # q_x > 0 because x was drawn from q; u < p/q is min(1, p/q) in distribution.
    accepted = (u * q_x < p_x).long().cumprod(0)
    n = int(accepted.sum())
    if n < ell:
        residual = (target_probs[n] - draft_probs[n]).clamp_min(0)
        total = residual.sum()
        dist = residual / total if total > 0 else target_probs[n]
    else:
        dist = target_probs[n]
    return n, torch.multinomial(dist, 1, generator=generator)[0]


def verify_row(draft_tokens, draft_probs, raw_logits, history, logits_processor, do_sample):
    """Exact acceptance for one row: draft_tokens [ℓ], draft_probs [ℓ, V] | None, raw target logits [ℓ+1, V],
    history [T] (the row's committed tokens) -> (n accepted, next token, processed target scores [ℓ+1, V])."""
    if logits_processor:  # each position's processors see the row's history up to it
        candidate, base = torch.cat([history, draft_tokens]), history.shape[0]
        scores = torch.cat([process(logits_processor, candidate[None, : base + i], raw_logits[i : i + 1])
                            for i in range(len(raw_logits))])  # fmt: skip
    else:  # nothing to process: the raw logits are the scores, uncopied (a copy of [ℓ+1, V] floats a row a round)
        scores = raw_logits
    if do_sample:
        n, nxt = rejection_sample(draft_tokens, draft_probs, probs(scores))
    else:
        n, nxt = greedy_accept(draft_tokens, scores)
    return n, nxt, scores
