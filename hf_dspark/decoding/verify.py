"""Exact acceptance over what a row verified (docs/method.md, "Verification" and "Token trees"): one rule, ``walk``,
for chains and trees alike.

From the anchor, at each slot the target's processed distribution p (given the slot's path) decides which child,
if any, the walk moves to; at the first slot where it takes none, it draws the round's new token. Greedy: the child
holding p's argmax. Sampling: a chain's token x drawn from the draft's q (one-hot for a looked-up token) is kept with
probability min(1, p(x) / q(x)), and after a rejection the new token is drawn from norm(max(0, p - q)); a tree's
deterministic children are kept when p's own draw is one of them; a slot with sampled children among others runs
recursive rejection over all of them. Either way every committed token follows p, the target's processed
distribution (temperature, top-k, top-p, …), exactly.

    walk              the one acceptance: -> the accepted slots, the next token, the processed scores on the path
    greedy_accept     a chain's greedy acceptance, all slots at once
    rejection_sample  a sampled chain's acceptance against q, all slots at once
    _rejection_step   one slot of a tree with sampled children: recursive rejection
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation import LogitsProcessorList

from .tree import VerifiedTree


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


@dataclass
class Walk:
    """What exact acceptance found: ``slots`` the accepted slots, root to leaf; ``next_token`` the target's
    choice after them (the correction or bonus token); ``scores`` [n + 1, V] the processed target scores at the
    anchor and at each accepted slot (the ones plain decoding would have seen); ``committed``: how many of the
    n + 1 tokens the row committed (fewer where generation stopped inside them; set by the round's commit)."""

    slots: list[int]
    next_token: torch.Tensor
    scores: torch.Tensor
    committed: int = 0


def walk(
    verified: VerifiedTree,
    raw_logits: torch.Tensor,
    history: torch.Tensor,
    logits_processor: LogitsProcessorList,
    do_sample: bool,
) -> Walk:
    """Exact acceptance over what one row verified: raw target logits [1 + B, V] for its slots, the row's committed
    ``history`` [T] (ending with the anchor). -> :class:`Walk`.

    A chain without processors (greedy), or with proposal distributions (sampled), is accepted all slots at once;
    otherwise the walk goes slot by slot, each slot's scores processed with that slot's own path."""
    if verified.probs is not None:  # a sampled chain: each token against the q it was drawn from
        if not verified.is_chain:
            raise ValueError("proposal distributions are tested along a chain; a tree's candidates are deterministic")
        tokens = verified.slot_tokens
        scores = _chain_scores(tokens, raw_logits, history, logits_processor)
        n, nxt = rejection_sample(tokens, verified.probs, probs(scores))
        return Walk(list(range(1, n + 1)), nxt, scores[: n + 1])
    if not do_sample and not logits_processor:
        return _greedy_walk(verified, raw_logits)
    slot, path, tokens, scores = 0, [], history, []
    while True:
        score = process(logits_processor, tokens[None], raw_logits[slot : slot + 1])
        scores.append(score)
        if do_sample and verified.sampled:
            child, choice = _rejection_step(verified, slot, probs(score)[0])
        else:
            choice = torch.multinomial(probs(score)[0], 1)[0] if do_sample else score[0].argmax()
            child = verified.children.get((slot, int(choice)))
        if child is None:
            return Walk(path, choice, torch.cat(scores))
        path.append(child)
        tokens = torch.cat([tokens, choice[None]])
        slot = child


def _rejection_step(verified: VerifiedTree, slot: int, p: torch.Tensor) -> tuple[int | None, torch.Tensor]:
    """Sampling at one slot of a tree with sampled children (``verified.sampled``): recursive rejection over its
    children, p [V] the target's processed distribution there. Each candidate is tested against the residual r
    (p at first): a deterministic child x is kept with probability r(x) / Σr, and on a rejection r(x) becomes 0; a
    child x drawn from q is kept with probability min(1, r̂(x) / q(x)) (r̂ = r normalised), and on a rejection r
    becomes max(0, r̂ - q). With none kept the new token is drawn from r. Every step passes on exactly the law of
    its residual, so the token this slot commits follows p, whatever the children (deterministic ones first, then
    the sampled; a node another proposer also proposed is a candidate of each kind). -> (child slot or None, the
    slot's token)."""
    kids = [c for c in range(1, verified.size + 1) if verified.parent_slots[c] == slot]
    if not any(c in verified.sampled for c in kids):  # deterministic children only: p's own draw picks among them
        choice = torch.multinomial(p, 1)[0]
        return verified.children.get((slot, int(choice))), choice
    ids = verified.slot_tokens.tolist()
    candidates = [(c, None) for c in kids if c not in verified.sampled or c in verified.deterministic]
    candidates += [(c, verified.sampled[c]) for c in kids if c in verified.sampled]
    residual = p.clone()
    for c, q in candidates:
        x, total = ids[c - 1], residual.sum()
        if q is None:
            if bool(torch.rand((), device=p.device, dtype=p.dtype) * total < residual[x]):
                return c, verified.slot_tokens[c - 1].to(p.device)
            residual[x] = 0
            continue
        target = residual / total
        if bool(torch.rand((), device=p.device, dtype=p.dtype) * q[x] < target[x]):
            return c, verified.slot_tokens[c - 1].to(p.device)
        left = (target - q.to(target)).clamp_min(0)
        residual = left if bool(left.sum() > 0) else target
    return None, torch.multinomial(residual, 1)[0]


def _chain_scores(tokens, raw_logits, history, logits_processor) -> torch.Tensor:
    """A chain's processed scores [ℓ + 1, V]: each position's processors see the history and the chain up to it
    (without processors, the raw logits, uncopied)."""
    if not logits_processor:
        return raw_logits
    candidate, base = torch.cat([history, tokens.to(history.device)]), history.shape[0]
    return torch.cat([process(logits_processor, candidate[None, : base + i], raw_logits[i : i + 1])
                      for i in range(len(raw_logits))])  # fmt: skip


def _greedy_walk(verified: VerifiedTree, raw_logits: torch.Tensor) -> Walk:
    """Greedy without processors: every slot's argmax at once (one transfer), the path followed on the host."""
    if verified.is_chain:
        n, nxt = greedy_accept(verified.slot_tokens.to(raw_logits.device), raw_logits)
        return Walk(list(range(1, n + 1)), nxt, raw_logits[: n + 1])
    argmax = raw_logits.argmax(-1)
    choices, slot, path = argmax.tolist(), 0, []
    while (child := verified.children.get((slot, choices[slot]))) is not None:
        path.append(child)
        slot = child
    return Walk(path, argmax[slot], raw_logits[[0, *path]])
