"""Lookup drafting: propose what followed the last time the text said what it says now.

Code and worked answers repeat their prompt and themselves (identifiers, numbers, whole lines). When a row's last
n tokens occurred earlier in its history, the tokens that followed that occurrence are a free draft, often longer
and surer than a small draft model's. The DSpark loop verifies such a continuation in place of the draft's block
(``DecodingConfig.lookup_max_ngram``); verification is unchanged, so the output stays exactly the target's. The
proposal is deterministic, so for sampling its q is one-hot (:func:`one_hot_probs`) and rejection sampling accepts
a looked-up token x with probability p(x).
"""

from __future__ import annotations

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


def lookups(settings, histories: list[torch.Tensor], room: list[int]) -> dict[int, torch.Tensor]:
    """Lookup drafting for one round: {row: the continuation [k ≤ room[r]] it verifies}, for the rows with room
    whose last n-gram occurred earlier in their history (``settings``, a ``DecodingConfig``: ``lookup_max_ngram``
    down to ``lookup_min_ngram``)."""
    found = {}
    for r, h in enumerate(histories):
        if room[r] > 0:
            tokens = lookup_continuation(h, settings.lookup_max_ngram, settings.lookup_min_ngram, room[r])
            if tokens.numel():
                found[r] = tokens
    return found
