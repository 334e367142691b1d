"""Lookup drafting: propose what followed the last time the text said what it says now.

Code and worked answers repeat their prompt and themselves (identifiers, numbers, whole lines). When a row's last
n tokens occurred earlier in its history, the tokens that followed that occurrence are a free draft, often longer
and surer than a small draft model's (``DecodingConfig.lookup_max_ngram``). One :class:`LookupProposer` serves a
call's rounds: a chain round verifies its continuation in place of the draft's block, a tree round adds it as a
branch; verification is unchanged, so the output stays exactly the target's. The proposal is deterministic, so for
sampling its q is one-hot (:func:`one_hot_probs`) and rejection sampling accepts a looked-up token x with
probability p(x).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def lookup_continuation(history: torch.Tensor, max_ngram: int, min_ngram: int, max_tokens: int) -> torch.Tensor:
    """The tokens that followed the latest earlier occurrence of ``history``'s last n-gram, trying n from
    ``max_ngram`` down to ``min_ngram`` (longer matches first: they predict better), at most ``max_tokens`` of them.

    history [T] (token ids) -> [k], k = ``max_tokens`` when an n-gram in range occurred before, else 0.
    The latest occurrence is preferred to the first: in code and arithmetic the nearest repeat is the likeliest
    to continue the same way. When what followed it runs into the end of the history (an occurrence P tokens back
    means the text repeats with period P), the continuation keeps repeating it: a loop is proposed in full.
    """
    if min_ngram < 1 or max_ngram < min_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
    T = history.shape[0]
    if max_tokens <= 0:
        return history[:0]
    for n in range(min(max_ngram, T - 1), min_ngram - 1, -1):
        # every n-gram that ends before the last token, so each has at least one token after it
        windows = history[: T - 1].unfold(0, n, 1)
        hits = (windows == history[T - n :]).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            period = T - start  # the suffix repeats the text `period` tokens back: so does what follows it
            return history[start + torch.arange(max_tokens, device=history.device) % period]
    return history[:0]


def one_hot_probs(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The proposal distribution of a deterministic draft: tokens [ℓ] -> q [ℓ, vocab_size], one-hot, float32."""
    return torch.nn.functional.one_hot(tokens, vocab_size).float()


@dataclass
class LookupProposer:
    """A call's lookup drafting: the continuation of a row's last n-gram's latest earlier occurrence
    (:func:`lookup_continuation`, n from ``max_ngram`` down to ``min_ngram``), at most ``width`` tokens.

    Two things it learns from the call's rounds: ``rate``, the observed acceptance of a looked-up token whose parent
    was reached (a Beta(1, 1) prior; a tree values a node k deep at rate^k), and, with ``adaptive``
    (``lookup_adaptive``), the width: the first lookup verifies at most γ (``draft_tokens``) tokens, one accepted
    in full makes the next twice its length (at least γ: a short continuation accepted whole is no reason to verify
    less than a drafted block; at most ``max_tokens``), one cut short sets it back to γ."""

    max_ngram: int
    min_ngram: int
    max_tokens: int  # ``lookup_max_tokens`` (γ when unset)
    draft_tokens: int  # γ
    adaptive: bool = False
    earned: int | None = None  # ``adaptive``: the width the last whole lookup earned (None: γ)
    accepted: float = 1.0  # a Beta(1, 1) prior on the per-token acceptance
    reached: float = 2.0

    @classmethod
    def of(cls, settings, draft_tokens: int) -> LookupProposer | None:
        """The call's lookup from its settings (a ``DecodingConfig``), or None when lookup drafting is off."""
        if settings.lookup_max_ngram == 0:
            return None
        cap = settings.lookup_max_tokens or draft_tokens
        return cls(settings.lookup_max_ngram, settings.lookup_min_ngram, cap, draft_tokens, settings.lookup_adaptive)

    @property
    def rate(self) -> float:
        return self.accepted / self.reached

    @property
    def width(self) -> int:
        """The most tokens the next continuation proposes."""
        return min(self.max_tokens, self.earned or self.draft_tokens) if self.adaptive else self.max_tokens

    def continuation(self, history: torch.Tensor, room: int) -> torch.Tensor:
        """history [T] -> the continuation [k ≤ min(width, room)] (empty: no earlier occurrence, or no room)."""
        return lookup_continuation(history, self.max_ngram, self.min_ngram, min(self.width, room))

    def propose(self, candidates: list, requests: list) -> None:
        """Each request's continuation (at most its ``lookup_depth``, default its ``max_depth``) into its row's
        candidates, each token valued at the observed rate (a :class:`~hf_dspark.decoding.proposers.Proposer`)."""
        for candidate, request in zip(candidates, requests, strict=True):
            depth = request.max_depth if request.lookup_depth is None else request.lookup_depth
            found = self.continuation(request.history, depth)
            if found.numel():
                candidate.add_continuation(found, self.rate, "lookup")

    def observe(self, reached: int, accepted: int) -> None:
        """``reached`` looked-up tokens whose parent was on the accepted path, ``accepted`` of them kept."""
        self.reached += reached
        self.accepted += accepted

    def observe_width(self, verified: int, accepted: int) -> None:
        """After a continuation of ``verified`` tokens had ``accepted`` of them kept: the adaptive width's rule."""
        if self.adaptive and verified:
            whole = accepted == verified
            self.earned = max(self.draft_tokens, min(2 * verified, self.max_tokens)) if whole else None
