"""Is a greedy output that parts from plain greedy a near-tie or a bug? One rule, used by the main command,
`hf-dspark bench` and the demo.

In bfloat16/float16 a forward over several tokens rounds differently from a one-token step, so a near-tie in the
target's logits can flip under any multi-token verifier (transformers' prompt lookup included). A difference is
explained when, at the first differing token, both tokens' logits lie within two units of the target dtype's
rounding of the top logit, as the target computes them or as the same weights upcast to float32 do (over a long
context a low-precision forward drifts by more than two units from one batch shape to another: seen here, 21.157
vs 21.152 in float32 were three bfloat16 units apart in bfloat16). In float32 and float64 no difference is
explained: it is a bug.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch


@dataclass
class Divergence:
    """Where two greedy outputs first part, and the target's logits for both tokens there.

    ``index`` counts generated tokens (0 = the first new token) when ``prompt_len`` was given, else positions.
    ``logits[name] = (ours, reference's, top)`` per model asked ("bfloat16", "float32", ...).
    """

    index: int
    token: int
    reference_token: int
    logits: dict[str, tuple[float, float, float]]
    tie: bool

    def describe(self, tokenizer=None) -> str:
        """One line: the token index, both candidates, their logits per dtype, and the verdict."""

        def name(t: int) -> str:
            return f"{t} {tokenizer.decode([t])!r}" if tokenizer is not None else str(t)

        values = "; ".join(f"{dt} {a:.3f} vs {b:.3f} (top {top:.3f})" for dt, (a, b, top) in self.logits.items())
        verdict = "a near-tie (within 2 rounding units of the top logit)" if self.tie else "NOT a tie"
        return (
            f"parts at new token {self.index}: {name(self.token)} vs plain's {name(self.reference_token)}; "
            f"logits {values}: {verdict}"
        )


def upcast_copy(model):
    """The same weights, computed in float32 (``nn.Module.to``: a GGUF-loaded model refuses its own ``.float()``)."""
    return torch.nn.Module.to(copy.deepcopy(model), torch.float32)


@torch.no_grad()
def first_divergence(target, out: torch.Tensor, reference: torch.Tensor, exact=None, prompt_len: int = 0):
    """Compare two greedy outputs ([1, T] each); ``None`` when they are equal.

    Recomputes the target's logits at the first differing position (one forward per model) and calls it a tie when
    both tokens are within two units of rounding of the target's dtype (``finfo(target.dtype).eps`` times the top
    logit's magnitude) of the largest logit, as computed by ``target`` or by ``exact`` (the same weights in
    float32, optional). A strict-prefix difference (one output stops earlier) is never a tie. Callers treat every
    difference in float32/float64 as a bug whatever this says; it still tells them where and how far apart.
    """
    a, b = out[0].tolist(), reference[0].tolist()
    if a == b:
        return None
    k = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), None)
    if k is None:  # one is a strict prefix of the other: a length/EOS difference, never a tie
        j = min(len(a), len(b))
        extra = a[j] if len(a) > j else -1
        ref_extra = b[j] if len(b) > j else -1
        return Divergence(j - prompt_len, extra, ref_extra, {}, False)
    prefix = torch.tensor([b[:k]], device=target.device)
    eps = torch.finfo(target.dtype).eps
    logits, tie = {}, False
    for model in (target, exact):
        if model is None:
            continue
        row = model(prefix).logits[0, -1].float()
        top = row.max()
        tol = 2 * eps * top.abs().clamp_min(1.0)
        logits[str(model.dtype).removeprefix("torch.")] = (float(row[a[k]]), float(row[b[k]]), float(top))
        tie = tie or bool(top - row[a[k]] <= tol and top - row[b[k]] <= tol)
    return Divergence(k - prompt_len, a[k], b[k], logits, tie)


def parts_at_a_tie(target, out: torch.Tensor, reference: torch.Tensor, exact=None) -> bool:
    """Whether two greedy outputs ([1, T] each) first differ at a near-tie (see :func:`first_divergence`)."""
    found = first_divergence(target, out, reference, exact)
    return found is not None and found.tie
