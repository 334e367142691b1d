"""One sequential-head step, fused: low-rank bias, temperature, logsumexp, argmax/sample and confidence.

For R rows (shapes: U [R, V], prev [R], W1 [V, r], W2 [V, r] as stored by ``nn.Linear(r, V)``, h [R, d]):

    e      = W1[prev]  (Markov)   or  code [R, r]  (RNN head: tanh(W_o z_k))
    x      = (U + e W2ᵀ) / T                       -> logits [R, V] (fp32)
    lse    = logsumexp(x)                           -> [R]
    token  = argmax x  or  argmax (x + Gumbel)      -> [R] (Gumbel-max: an exact sample from softmax(x))
    c      = σ((w[:d]·h + w[d:]·e + b) / T_conf)    -> [R]

Grid (R, ⌈V / BLOCK_V⌉). Each program streams its W2 tile once (fp32 accumulation whatever the weight dtype),
writes its logits and a partial (max, Σexp, best, best-perturbed); an atomic counter (acquire-release, so the last
program sees every partial) elects the row's last program, which reduces the partials in fixed-size chunks and
computes the confidence. One launch per step.

Memory traffic per step (R rows, V vocabulary, rank r, weights of b bytes): W2 is read once, V·r·b bytes (the
floor: every bias needs all of W2); U is read and the logits written, R·V·(b + 4); the partials, 6·4 bytes per
tile, are written once and read once by the row's last program. For V = 151,936, r = 64, bf16 and R = 1 that is
19.4 MB of W2 against 0.9 MB for everything else: within 5% of the W2 floor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Fixed tile sizes: the compiled kernel is the same for every vocabulary, rank and hidden size (masks cover the
# rest), its registers do not grow with any of them, and benchmarks/kernel_resources.py can compile every variant
# ahead of time. BLOCK_R = 16: a [128, 16] W2 tile holds 16 values and 16 64-bit pointers per thread (80 registers
# on sm_90, no stack); 64 took 255 registers and spilled (a row's 16 bf16 values are still one 32-byte sector).
# BLOCK_T: partials reduced per step of the last program's loop.
LAUNCH_BLOCKS = {"BLOCK_R": 16, "BLOCK_D": 256, "BLOCK_T": 64}
DEFAULT_BLOCK_V = 128


@triton.jit
def _lowrank_step_kernel(
    U_ptr,
    stride_u,
    prev_ptr,
    W1_ptr,
    code_ptr,
    W2_ptr,
    inv_temp,
    seed,
    out_ptr,
    part_ptr,
    count_ptr,
    H_ptr,
    Wc_ptr,
    conf_bias,
    conf_inv_temp,
    tok_ptr,
    lse_ptr,
    conf_ptr,
    V,
    RANK,
    D,
    N_TILES,
    BLOCK_V: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    GATHER: tl.constexpr,
    SAMPLE: tl.constexpr,
    HAS_CONF: tl.constexpr,
):
    row = tl.program_id(0)
    tile = tl.program_id(1)
    offs_v = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    vmask = offs_v < V
    if GATHER:
        code_row = W1_ptr + tl.load(prev_ptr + row).to(tl.int64) * RANK
    else:
        code_row = code_ptr + row.to(tl.int64) * RANK
    bias = tl.zeros([BLOCK_V], dtype=tl.float32)
    for r0 in range(0, RANK, BLOCK_R):  # rank in chunks: the [BLOCK_V, BLOCK_R] tile stays in registers
        offs_r = r0 + tl.arange(0, BLOCK_R)
        rmask = offs_r < RANK
        code = tl.load(code_row + offs_r, mask=rmask, other=0.0).to(tl.float32)
        w2 = tl.load(
            W2_ptr + offs_v.to(tl.int64)[:, None] * RANK + offs_r[None, :],
            mask=vmask[:, None] & rmask[None, :],
            other=0.0,
        ).to(tl.float32)
        bias += tl.sum(w2 * code[None, :], axis=1)
    u = tl.load(U_ptr + row * stride_u + offs_v, mask=vmask, other=0.0).to(tl.float32)
    x = tl.where(vmask, (u + bias) * inv_temp, float("-inf"))
    tl.store(out_ptr + row.to(tl.int64) * V + offs_v, x, mask=vmask)

    m = tl.max(x, axis=0)
    # a tile may be all -inf (a draft vocabulary masks most of the vocabulary): its Σexp is 0, not exp(nan)
    s = tl.sum(tl.exp(x - tl.where(m == float("-inf"), 0.0, m)), axis=0)
    best_val, best_idx = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    if SAMPLE:
        r = tl.rand(seed, row * V + offs_v)
        r = tl.minimum(tl.maximum(r, 1e-20), 1.0 - 1e-7)
        y = tl.where(vmask, x - tl.log(-tl.log(r)), float("-inf"))
        g_val, g_idx = tl.max(y, axis=0, return_indices=True, return_indices_tie_break_left=True)
    else:
        g_val = best_val
        g_idx = best_idx
    base = part_ptr + (row * N_TILES + tile) * 6
    tl.store(base + 0, m)
    tl.store(base + 1, s)
    tl.store(base + 2, best_val)
    tl.store(base + 3, (best_idx + tile * BLOCK_V).to(tl.float32))
    tl.store(base + 4, g_val)
    tl.store(base + 5, (g_idx + tile * BLOCK_V).to(tl.float32))

    done = tl.atomic_add(count_ptr + row, 1, sem="acq_rel")
    if done == N_TILES - 1:
        # the row's last program reduces the partials in chunks of BLOCK_T (online logsumexp and argmax), so the
        # registers it needs do not grow with the vocabulary
        which = 2 if not SAMPLE else 4
        big = float("-inf")
        total = 0.0
        best = float("-inf")
        token = 0.0
        for t0 in range(0, N_TILES, BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T)
            tmask = offs_t < N_TILES
            parts = part_ptr + (row * N_TILES + offs_t) * 6
            ms = tl.load(parts + 0, mask=tmask, other=float("-inf"))
            ss = tl.load(parts + 1, mask=tmask, other=0.0)
            chunk_big = tl.maximum(tl.max(ms, axis=0), big)
            shift = tl.where(chunk_big == float("-inf"), 0.0, chunk_big)
            total = total * tl.exp(big - shift) + tl.sum(tl.where(ms == float("-inf"), 0.0, ss * tl.exp(ms - shift)))
            big = chunk_big
            vals = tl.load(parts + which, mask=tmask, other=float("-inf"))
            idxs = tl.load(parts + which + 1, mask=tmask, other=0.0)
            chunk_best, at = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
            chunk_token = tl.sum(tl.where(tl.arange(0, BLOCK_T) == at, idxs, 0.0), axis=0)
            take = chunk_best > best  # strict: an equal value in a later chunk has a larger index (left tie-break)
            token = tl.where(take, chunk_token, token)
            best = tl.where(take, chunk_best, best)
        tl.store(lse_ptr + row, big + tl.log(total))
        tl.store(tok_ptr + row, token.to(tl.int64))
        if HAS_CONF:
            logit = conf_bias
            for d0 in range(0, D, BLOCK_D):
                offs_d = d0 + tl.arange(0, BLOCK_D)
                dmask = offs_d < D
                h = tl.load(H_ptr + row * D + offs_d, mask=dmask, other=0.0).to(tl.float32)
                w_h = tl.load(Wc_ptr + offs_d, mask=dmask, other=0.0).to(tl.float32)
                logit += tl.sum(h * w_h, axis=0)
            for r0 in range(0, RANK, BLOCK_R):
                offs_r = r0 + tl.arange(0, BLOCK_R)
                rmask = offs_r < RANK
                code = tl.load(code_row + offs_r, mask=rmask, other=0.0).to(tl.float32)
                w_e = tl.load(Wc_ptr + D + offs_r, mask=rmask, other=0.0).to(tl.float32)
                logit += tl.sum(code * w_e, axis=0)
            tl.store(conf_ptr + row, tl.sigmoid(logit * conf_inv_temp))


def _check(name: str, t: torch.Tensor, shape: tuple, dtypes, device: torch.device) -> None:
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (all inputs on one device)")


def lowrank_step(
    base_logits: torch.Tensor,
    w2: torch.Tensor,
    prev: torch.Tensor | None = None,
    w1: torch.Tensor | None = None,
    code: torch.Tensor | None = None,
    temperature: float = 1.0,
    sample: bool = False,
    seed: int = 0,
    hidden: torch.Tensor | None = None,
    conf_weight: torch.Tensor | None = None,
    conf_bias: float = 0.0,
    conf_temperature: float = 1.0,
    block_v: int = DEFAULT_BLOCK_V,
):
    """Run one fused head step. Give either (``prev``, ``w1``) for the Markov head or ``code`` [R, r].

    Returns ``(logits [R, V] fp32, tokens [R] int64, lse [R] fp32, confidence [R] fp32 or None)``; the processed
    draft distribution is ``exp(logits - lse[:, None])``.
    """
    if base_logits.dim() != 2:
        raise ValueError(f"base_logits must be [R, V], got shape {tuple(base_logits.shape)}")
    R, V = base_logits.shape
    device = base_logits.device
    if w2.dim() != 2 or w2.shape[0] != V:
        raise ValueError(f"w2 must be [V={V}, r] (nn.Linear(r, V).weight), got {tuple(w2.shape)}")
    rank = w2.shape[1]
    _check("base_logits", base_logits, (R, V), _FLOAT_DTYPES, device)
    _check("w2", w2, (V, rank), _FLOAT_DTYPES, device)
    gather = code is None
    if gather:
        if prev is None or w1 is None:
            raise ValueError("give prev and w1 (Markov head) or code (RNN head)")
        _check("prev", prev, (R,), (torch.int64, torch.int32), device)
        _check("w1", w1, (V, rank), _FLOAT_DTYPES, device)
    else:
        _check("code", code, (R, rank), _FLOAT_DTYPES, device)
    has_conf = conf_weight is not None
    d = 1
    if has_conf:
        if hidden is None:
            raise ValueError("conf_weight needs hidden [R, d]")
        d = hidden.shape[-1]
        _check("hidden", hidden, (R, d), _FLOAT_DTYPES, device)
        _check("conf_weight", conf_weight, (d + rank,), _FLOAT_DTYPES, device)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")

    base_logits = base_logits.contiguous() if base_logits.stride(-1) != 1 else base_logits
    n_tiles = triton.cdiv(V, block_v)
    out = torch.empty(R, V, device=device, dtype=torch.float32)
    parts = torch.empty(R, n_tiles, 6, device=device, dtype=torch.float32)
    count = torch.zeros(R, device=device, dtype=torch.int32)
    tokens = torch.empty(R, device=device, dtype=torch.int64)
    lse = torch.empty(R, device=device, dtype=torch.float32)
    conf = torch.empty(R, device=device, dtype=torch.float32) if has_conf else lse
    dummy = out
    _lowrank_step_kernel[(R, n_tiles)](
        base_logits,
        base_logits.stride(0),
        prev.contiguous() if gather else dummy,
        w1.contiguous() if gather else dummy,
        dummy if gather else code.contiguous(),
        w2.contiguous(),
        1.0 / temperature,
        seed,
        out,
        parts,
        count,
        hidden.contiguous() if has_conf else dummy,
        conf_weight.contiguous() if has_conf else dummy,
        float(conf_bias),
        1.0 / conf_temperature,
        tokens,
        lse,
        conf,
        V,
        rank,
        d,
        n_tiles,
        BLOCK_V=block_v,
        **LAUNCH_BLOCKS,
        GATHER=gather,
        SAMPLE=sample,
        HAS_CONF=has_conf,
    )
    return out, tokens, lse, conf if has_conf else None


def lowrank_step_reference(
    base_logits,
    w2,
    prev=None,
    w1=None,
    code=None,
    temperature=1.0,
    sample=False,
    generator=None,
    hidden=None,
    conf_weight=None,
    conf_bias=0.0,
    conf_temperature=1.0,
):
    """The same math in PyTorch (fp32), the reference the kernel is tested against and the fallback path."""
    e = (w1[prev] if code is None else code).float()
    x = (base_logits.float() + e @ w2.float().T) / temperature
    lse = torch.logsumexp(x, dim=-1)
    if sample:
        tokens = torch.multinomial(torch.softmax(x, -1), 1, generator=generator)[:, 0]
    else:
        tokens = x.argmax(-1)
    conf = None
    if conf_weight is not None:
        d = hidden.shape[-1]
        logit = hidden.float() @ conf_weight[:d].float() + e @ conf_weight[d:].float() + conf_bias
        conf = torch.sigmoid(logit / conf_temperature)
    return x, tokens, lse, conf
