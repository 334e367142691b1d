"""Dispatch between the Triton head kernels (``dspark_heads``, from ``kernels/``) and the PyTorch path.

``HF_DSPARK_KERNELS`` chooses: ``auto`` (default: Triton for CUDA tensors of at most ``AUTO_MAX_ROWS`` rows, PyTorch
elsewhere), ``triton`` (force the kernels, e.g. on CPU under ``TRITON_INTERPRET=1``), ``torch`` (never use them).
The fused step serves the Markov and RNN heads when the logits processing is at most a temperature (top-k/top-p
and other processors run on the PyTorch path).
"""

from __future__ import annotations

import os

import torch
from transformers.generation import LogitsProcessorList, TemperatureLogitsWarper

from .heads import LowRankHead

BACKENDS = ("auto", "triton", "torch")
# The fused step reads W2 once per row, the PyTorch path once per step, so the kernel wins for few rows only: on an
# H200 up to R ≈ 22 at V = 151,936 (docs/design.md, "Triton kernels"; benchmarks/results/gpu_check), hence 16.
AUTO_MAX_ROWS = 16


def backend() -> str:
    choice = os.environ.get("HF_DSPARK_KERNELS", "auto").lower()
    if choice not in BACKENDS:
        raise ValueError(f"HF_DSPARK_KERNELS must be one of {BACKENDS}, got {choice!r}")
    return choice


def fused_temperature(logits_processor: LogitsProcessorList | None) -> float | None:
    """The temperature if the processors are at most one temperature warper, else ``None`` (not fusable)."""
    procs = list(logits_processor or [])
    if not procs:
        return 1.0
    if len(procs) == 1 and type(procs[0]) is TemperatureLogitsWarper:
        return float(procs[0].temperature)
    return None


def use_kernels(draft, device: torch.device, logits_processor, rows: int = 1) -> bool:
    """Whether draft_block should run the fused Triton step for this call of ``rows`` batch rows."""
    choice = backend()
    if choice == "torch" or (choice == "auto" and (device.type != "cuda" or rows > AUTO_MAX_ROWS)):
        return False
    head = draft.sequential_head
    if not draft.head_enabled or not isinstance(head, LowRankHead) or fused_temperature(logits_processor) is None:
        return False
    try:
        import dspark_heads  # noqa: F401
    except ImportError:  # a wheel installed without the kernels package
        return False
    return True


def fused_head_step(draft, base_logits, hidden, prev, state, temperature, sample, conf_temperature):
    """One head step through the kernel: -> (scores [R, V] fp32 processed, tokens [R], probs [R, V] | None,
    confidence [R] | None, state)."""
    from dspark_heads import lowrank_step

    head, conf_head = draft.sequential_head, draft.confidence
    full = draft.head_full_rows()  # set when W2 stores draft-vocabulary rows only
    w2 = head.output_weight if full is None else full
    seed = int(torch.randint(2**31 - 1, (1,)).item()) if sample else 0
    if not head.code_is_embedding or (conf_head is not None and conf_head.feature_size == 0):
        # the code comes computed (RNN, gated) and the confidence beside the kernel (it reads W1[x] or h_k alone)
        code, feature, state = head.low_rank_code(prev, hidden, state)
        scores, tokens, lse, _ = lowrank_step(
            base_logits, w2, code=code, temperature=temperature, sample=sample, seed=seed
        )
        conf = None
        if conf_head is not None:
            conf = conf_head.calibrated(conf_head.logit(hidden, feature), conf_temperature)
    else:  # the kernel gathers W1[x_{k-1}] itself and fuses the confidence head's dot product
        kw = {}
        if conf_head is not None:
            weight, bias = conf_head.weight_and_bias()
            kw = dict(hidden=hidden, conf_weight=weight, conf_bias=bias, conf_temperature=conf_temperature or 1.0)
        scores, tokens, lse, conf = lowrank_step(
            base_logits, w2, prev=prev, w1=head.embedding_weight, temperature=temperature, sample=sample, seed=seed,
            **kw,
        )  # fmt: skip
    probs = torch.exp(scores - lse[:, None]) if sample else None
    return scores, tokens, probs, conf, state
