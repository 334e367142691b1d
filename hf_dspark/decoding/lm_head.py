"""The target's LM head over a verify block, as one 2-D matmul, in whichever of two orientations is faster here.

A verify asks for logits at a few positions: ``F.linear(h, W)`` with h [M, d], M = 2..γ+1, against the head's
[V, d] weight. Some CPU BLAS builds take a slow small-M GEMM path for that shape, where ``W @ hᵀ`` (the same dot
products) is much faster (figures in docs/design.md, "The verify's LM head is timed both ways"). Other engines may
not care, so the choice is measured once per (dtype, shape, threads) on the CPU, never assumed; GPUs keep
``F.linear``.

Either way, on the CPU, the head sees its input as one contiguous [M, d] matrix. The prefill asks the model for the last
position's logits only (``logits_to_keep=1``), which hands the head a strided slice [R, 1, d] of the prompt's hidden
states; ``F.linear`` cannot fold that into one GEMM and broadcasts the weight into a batched matmul instead, which
in bfloat16 on a CPU took 444 ms for 8 rows against 1.8 ms for the same rows copied out (docs/design.md).
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F

MAX_ROWS = 64  # the orientation is timed at verify-sized inputs; beyond this ``F.linear`` is left to do its job
PAYS = 0.8  # transposed must take at most this fraction of F.linear's time to be used
MIN_ELEMENTS = 1 << 20  # a smaller head costs too little for its orientation to matter: left alone, untimed
_choices: dict[tuple, bool] = {}


def rows_matrix(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] as one contiguous [M, d] matrix (a view when it already is one, else a copy of its M rows)."""
    return x.reshape(-1, x.shape[-1]).contiguous()


def flat_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [..., d], weight [V, d] -> [..., V], on x as one contiguous [M, d] matrix
    (:func:`rows_matrix`): bit for bit ``F.linear``'s result on contiguous input, without its batched-matmul path
    for strided input."""
    return F.linear(rows_matrix(x), weight, bias).reshape(*x.shape[:-1], weight.shape[0])


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [..., d], weight [V, d] -> [..., V], computed as ``weight @ xᵀ`` when x
    holds 2..``MAX_ROWS`` rows (else by :func:`flat_linear`). Same products, another summation order: results agree
    to rounding, not bit for bit."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 2 <= rows <= MAX_ROWS:
        return flat_linear(x, weight, bias)
    out = (weight @ rows_matrix(x).T).T.contiguous()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def transposed_pays(weight: torch.Tensor) -> bool:
    """Whether :func:`few_rows_linear` beats ``F.linear`` on a verify-sized input (8 rows) against ``weight`` on
    this engine: timed once per (dtype, shape, threads) on the CPU (median of 3 after a warm-up each); ``False``
    on any other device and for heads under ``MIN_ELEMENTS`` weights."""
    if weight.device.type != "cpu" or weight.numel() < MIN_ELEMENTS:
        return False
    key = (weight.dtype, tuple(weight.shape), torch.get_num_threads())
    if key not in _choices:
        x = torch.randn(8, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        with torch.no_grad():
            linear = _median_seconds(functools.partial(F.linear, x, weight))
            transposed = _median_seconds(functools.partial(few_rows_linear, x, weight))
        _choices[key] = transposed <= PAYS * linear
    return _choices[key]


def _median_seconds(fn, reps: int = 3) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def plain_linear_head(target) -> torch.nn.Linear | None:
    """The target's output embeddings when they are a plain ``nn.Linear`` nobody has wrapped (no hooks, no
    accelerate offload hook, no patched ``forward``), else ``None``: only such a head is safe to re-route."""
    head = target.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head._forward_hooks or head._forward_pre_hooks:
        return None
    if hasattr(head, "_hf_hook") or ("forward" in vars(head) and not _ours(head)):
        return None
    return head


def _ours(head: torch.nn.Module) -> bool:
    return getattr(vars(head).get("forward"), "hf_dspark_verify_head", False)


def head_orientation(target) -> str:
    """``"transposed"`` when :func:`verify_head` re-routes the target's head on this engine, else ``"linear"``."""
    head = plain_linear_head(target)
    return "transposed" if head is not None and transposed_pays(head.weight) else "linear"


@contextlib.contextmanager
def verify_head(target) -> Iterator[None]:
    """Within this block, a plain ``nn.Linear`` LM head of the target on the CPU computes on its input as one
    contiguous matrix (:func:`flat_linear`), and few-row inputs by :func:`few_rows_linear` where that is the faster
    orientation here (:func:`head_orientation`); after the block, on other devices (where neither was measured, and
    a compiled model would see its head's ``forward`` change), and for a head someone else wrapped, it is untouched.
    The decoding loop's forwards and the SPS profile's timed steps run inside it, so the scheduler prices the head
    the loop uses. Re-entering (or a second thread) while it is routed leaves the route as it is."""
    head = plain_linear_head(target)
    if head is None or _ours(head) or head.weight.device.type != "cpu":  # not ours to route, or already routed
        yield
        return
    linear = few_rows_linear if transposed_pays(head.weight) else flat_linear
    route = functools.partial(linear, weight=head.weight, bias=head.bias)
    route.hf_dspark_verify_head = True
    head.forward = route
    try:
        yield
    finally:
        # a call in another thread that entered meanwhile runs on with F.linear from here: slower, same numbers
        vars(head).pop("forward", None)
