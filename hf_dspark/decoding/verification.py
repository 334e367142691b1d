"""One verify for every round: each row's chain or tree in one target forward, each row's exact walk, both caches
keep the accepted paths. Chain rounds (chain.py) and tree rounds (tree_rounds.py) differ only in what they propose
and choose; from here on a chain is a tree of width one.

    verify_block   every active row's anchor + candidates as one [R, W] block: tokens, positions, the mask
    verify         the forward, the walks, the commits, both caches advanced
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scheduling.policy import bucket_width
from .checks import check_finite
from .state import Call, DecodeState, target_forward
from .tree import VerifiedTree, tree_attention_mask
from .verify import Walk, walk


@dataclass
class VerifyBlock:
    """The round's verify block: ``tokens`` [R, W] (each active row's anchor, then its candidates; padding after
    them and in finished rows), ``valid`` [R, W] (False for padding), ``positions`` [R, W] (anchor position + depth)
    and the target's attention ``mask`` (None, [R, S + W] or [R, 1, W, S + W])."""

    tokens: torch.Tensor
    valid: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor | None


def verify_block(
    state: DecodeState,
    verified: list[VerifiedTree | None],
    pad_id: int,
    dtype: torch.dtype,
    buckets: tuple[int, ...] | None = None,
) -> VerifyBlock:
    """The block for ``verified[r]`` (None for a finished row), as wide as the widest row needs or, with
    ``buckets`` (:func:`~hf_dspark.scheduling.policy.width_buckets`), the bucket that holds it: the one place a
    verify's width is set. When every row verifies a chain, positions are the slots' and the mask is the causal
    one over the cache and the block's valid slots (``None`` without holes: the cheaper path; on a CPU a 4D mask
    costs about 2 ms a step); otherwise each row's slots sit at their depths and attend to their ancestors
    (:func:`tree_attention_mask`)."""
    R, device = state.size, state.tokens.device
    width = 1 + max(v.size for v in verified if v is not None)
    if buckets is not None:
        width = bucket_width(width, buckets)
    tokens = torch.full((R, width), pad_id, dtype=torch.long, device=device)
    valid = torch.zeros(R, width, dtype=torch.bool, device=device)
    for r, v in enumerate(verified):
        if v is not None:
            tokens[r, 0] = state.tokens[r, state.lengths[r] - 1]
            tokens[r, 1 : 1 + v.size] = v.slot_tokens
            valid[r, : 1 + v.size] = True
    if all(v is None or v.is_chain for v in verified):
        positions = state.anchor_positions[:, None] + torch.arange(width, device=device)
        return VerifyBlock(tokens, valid, positions, state.attention_mask(valid))
    depths = [[0, *v.slot_depths] + [0] * (width - 1 - v.size) if v is not None else [0] * width for v in verified]
    positions = state.anchor_positions[:, None] + torch.tensor(depths, device=device)
    return VerifyBlock(tokens, valid, positions, tree_attention_mask(verified, state.cache_mask, dtype, width))


def verify(
    call: Call, state: DecodeState, verified: list[VerifiedTree | None], buckets: tuple[int, ...] | None = None
) -> list[Walk | None]:
    """Verify every row's candidates in one target forward (its width padded to ``buckets`` when given), walk each
    active row's accepted path exactly, commit it (token by token against the stopping criteria, streamed) and keep
    exactly those paths in both caches. -> each row's :class:`Walk` (None for a row that was already finished)."""
    rules, outputs = call.rules, call.outputs
    block = verify_block(state, verified, call.pad_id, call.target.dtype, buckets)
    out, fused = target_forward(call.target, block.tokens, block.positions, block.mask, call.cache, call.tap)
    raw = out.logits.float() if out.logits.dtype != torch.float64 else out.logits
    check_finite(raw, block.valid)  # one check (one sync on a GPU) for the whole block
    walks: list[Walk | None] = [None] * state.size
    paths: list[list[int]] = [[] for _ in range(state.size)]
    for r, v in enumerate(verified):
        if v is None:
            continue
        logits = raw[r, : 1 + v.size]
        result = walks[r] = walk(v, logits, state.history(r), rules.processors, rules.do_sample)
        n = len(result.slots)
        new = torch.cat([block.tokens[r, result.slots], result.next_token[None]])
        committed = state.commit(r, new, result.scores, rules.stopping)
        result.committed = committed
        if outputs.wanted:
            outputs.emit(new[:committed], result.scores, logits[[0, *result.slots]])
        state.anchor_positions[r] += n + 1
        paths[r] = [0, *result.slots]
    if state.active:
        state.keep_paths(paths, fused, block.positions)
    return walks
