"""GPU check of the fused head step (run on a CUDA machine; ~2 minutes on an H200).

    python -m benchmarks.kernels_gpu [--out benchmarks/results/kernels_gpu.json]

1. Correctness against the PyTorch reference at V ∈ {151936, 49152}, r = 256, R ∈ {1, 32, 128}, bf16 weights:
   logits/lse/confidence to tolerance, argmax tokens exactly.
2. Time per step (CUDA events, median of 50): fused kernel vs the PyTorch reference; achieved bandwidth against
   the W2 read floor (r·V·bytes per step).
3. Share of a round spent in the sequential head for a Qwen3-8B-size draft (hidden 4096, 1 layer, bf16, R = 128):
   γ head steps vs one backbone forward, γ ∈ {4, 8, 16}.
Goal: fused ≥ 3× the reference at R = 1 and within 2× of the W2-read floor at R = 128.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from dspark_heads import lowrank_step, lowrank_step_reference


def cuda_time(fn, reps: int = 50) -> float:
    """Median milliseconds of fn() measured with CUDA events (after warm-up)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def inputs(R, V, r, d=4096, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    return dict(
        base_logits=torch.randn(R, V, device="cuda", generator=g).to(dtype),
        prev=torch.randint(0, V, (R,), device="cuda", generator=g),
        w1=torch.randn(V, r, device="cuda", generator=g).to(dtype),
        w2=(torch.randn(V, r, device="cuda", generator=g) * 0.05).to(dtype),
        hidden=torch.randn(R, d, device="cuda", generator=g).to(dtype),
        conf_weight=(torch.randn(d + r, device="cuda", generator=g) * 0.01).to(dtype),
    )


def round_share(gamma: int, R: int = 128, L: int = 512) -> dict:
    """γ fused head steps vs one backbone forward of a Qwen3-8B-size draft (hidden 4096, one layer, bf16)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hf_dspark import DSparkDraftModel

    cfg = Qwen3Config(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=1,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    )
    target = Qwen3ForCausalLM(cfg).to("cuda", torch.bfloat16)  # one layer: only its embedding/LM head are used
    draft = DSparkDraftModel.from_target(
        target,
        block_size=gamma,
        num_draft_layers=1,
        head_rank=256,
        target_layer_ids=[1, 9, 17, 25, 33],
        target_num_layers=None,
    )
    head, (conf_weight, conf_bias) = draft.sequential_head, draft.confidence.weight_and_bias()
    feats = torch.randn(R, L, 5 * 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ctx = draft.context_key_values(feats, torch.arange(L, device="cuda").expand(R, L))
        emb = draft.embed_block(torch.zeros(R, dtype=torch.long, device="cuda"))
        pos = torch.arange(L, L + gamma, device="cuda").expand(R, gamma)
        t_backbone = cuda_time(lambda: draft(emb, pos, ctx), reps=20)
        out = draft(emb, pos, ctx)

        def heads():
            prev = torch.zeros(R, dtype=torch.long, device="cuda")
            for k in range(gamma):
                prev = lowrank_step(
                    out.logits[:, k],
                    head.output_weight,
                    prev=prev,
                    w1=head.embedding_weight,
                    hidden=out.hidden_states[:, k],
                    conf_weight=conf_weight,
                    conf_bias=conf_bias,
                )[1]

        t_heads = cuda_time(heads, reps=20)
    row = dict(gamma=gamma, backbone_ms=t_backbone, heads_ms=t_heads, head_share=t_heads / (t_heads + t_backbone))
    print(f"gamma={gamma:2d}  backbone {t_backbone:.2f} ms  heads {t_heads:.2f} ms  share {row['head_share']:.1%}")
    return row


def kernel_checks() -> list[dict]:
    """Sections 1 and 2: correctness and time per step at V ∈ {151936, 49152}, R ∈ {1, 32, 128} (CUDA only)."""
    rows, r = [], 256
    for V in (151936, 49152):
        for R in (1, 32, 128):
            kw = inputs(R, V, r)
            got = lowrank_step(**kw)
            ref = lowrank_step_reference(**kw)
            ok = torch.equal(got[1], ref[0].argmax(-1))
            err = max((a - b).abs().max().item() for a, b in zip(got[::2] + got[3:], ref[::2] + ref[3:], strict=True))
            t_kernel = cuda_time(lambda kw=kw: lowrank_step(**kw))
            t_ref = cuda_time(lambda kw=kw: lowrank_step_reference(**kw))
            floor_bytes = r * V * 2
            bw = floor_bytes / (t_kernel * 1e-3) / 1e9
            rows.append(
                dict(
                    V=V,
                    R=R,
                    r=r,
                    argmax_exact=ok,
                    max_abs_err=err,
                    kernel_ms=t_kernel,
                    reference_ms=t_ref,
                    speedup=t_ref / t_kernel,
                    w2_floor_GBps=bw,
                )
            )
            print(
                f"V={V:6d} R={R:3d}  exact={ok} err={err:.2e}  kernel {t_kernel:.3f} ms  ref {t_ref:.3f} ms  "
                f"x{t_ref / t_kernel:.1f}  W2 stream {bw:.0f} GB/s"
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/kernels_gpu.json")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    rows = kernel_checks()
    share = [round_share(gamma) for gamma in (4, 8, 16)]
    result = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        host=platform.node(),
        date=time.strftime("%Y-%m-%d"),
        steps=rows,
        round_share=share,
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
