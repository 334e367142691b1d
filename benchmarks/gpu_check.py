"""The one prepared GPU check: kernels and DSpark decoding end to end on CUDA, in one ≤ 10-minute command.

    python -m benchmarks.gpu_check --out benchmarks/results/gpu_check [--shape qwen3-0.6b|tiny] [--prompts 4]

From the repository root. On a bare checkout (a borrowed GPU machine without the package installed) the package is
found there too; the kernels, which an install puts beside it as ``dspark_heads``, need their folder on the path:
``PYTHONPATH=kernels/torch-ext python3 -m benchmarks.gpu_check ...``.

No network and no download: the target is a randomly initialised Qwen3-0.6B-shaped model (``--shape tiny`` for a
dry run), the draft a ``from_target`` draft. Sections:

1. kernels (CUDA only): ``benchmarks/kernels_gpu.py``'s correctness and time per step of the fused head step.
2. decode, float32: DSpark greedy output equals plain ``generate`` on every prompt, with chains and top-4 trees.
3. decode, bfloat16: outputs that part from plain greedy do so only at near-ties (``hf_dspark.evaluation.ties``).
4. costs: the SPS profile measured on the device, the draft block's time against a verify step, a token tree's
   verify (B up to 64 nodes) and drafting cost, and the peak memory of plain and DSpark ``generate`` with the
   draft's weights (CUDA allocator; skipped on CPU).

Writes ``gpu_check.json`` and ``gpu_check.md`` into ``--out`` and prints a one-screen summary. Anything that needs
CUDA is reported as skipped, with the reason, where there is none: the same script is the CPU dry run.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
}  # fmt: skip


def skipped(reason: str) -> dict:
    return {"skipped": reason}


def build(shape: str, device: str, dtype: torch.dtype):
    """(target, draft) with fixed seeds: a random target of the given shape and a draft built from it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hf_dspark import DSparkDraftModel

    torch.manual_seed(0)
    config = Qwen3Config(max_position_embeddings=2048, pad_token_id=0, bos_token_id=None, eos_token_id=None,
                         tie_word_embeddings=False, **SHAPES[shape])  # fmt: skip
    target = Qwen3ForCausalLM(config).to(device, dtype).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(8)  # a random model's logits are nearly flat; sharpen them so ties are rare
    draft = DSparkDraftModel.from_target(target, block_size=8, num_draft_layers=1, head_rank=64).to(device, dtype)
    return target, draft


def prompts(n: int, vocab: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (1, 16 + 24 * i), generator=g).to(device) for i in range(n)]


def decode_check(shape: str, device: str, dtype: torch.dtype, n: int, new_tokens: int) -> dict:
    """Greedy DSpark vs plain generate on n prompts; in low precision every difference must be a near-tie."""
    from hf_dspark import dspark_generate
    from hf_dspark.evaluation.ties import first_divergence, upcast_copy

    target, draft = build(shape, device, dtype)
    draft.decoding.verify_mode = "fixed"
    exact = dtype == torch.float32
    upcast = None if exact else upcast_copy(target)
    rows = []
    for ids in prompts(n, target.config.vocab_size, device):
        ref = target.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        out = target.generate(ids, max_new_tokens=new_tokens, do_sample=False, custom_generate=dspark_generate,
                              draft=draft)  # fmt: skip
        found = first_divergence(target, out, ref, upcast, prompt_len=ids.shape[1])
        tree = target.generate(ids, max_new_tokens=new_tokens, do_sample=False, custom_generate=dspark_generate,
                               draft=draft, tree_top_k=4)  # fmt: skip
        tree_found = first_divergence(target, tree, ref, upcast, prompt_len=ids.shape[1])
        rows.append({
            "prompt_tokens": ids.shape[1], "identical": found is None, "rounds": draft.stats.rounds,
            "difference": None if found is None else found.describe(), "tie": None if found is None else found.tie,
            "tree_identical": tree_found is None, "tree_tie": None if tree_found is None else tree_found.tie,
            "tree_fallback": draft.stats.tree_fallback,
        })  # fmt: skip
    ok = (
        all(r["identical"] and r["tree_identical"] for r in rows)
        if exact
        else all((r["identical"] or r["tie"]) and (r["tree_identical"] or r["tree_tie"]) for r in rows)
    )
    return {"dtype": str(dtype).removeprefix("torch."), "ok": ok, "prompts": rows}


def cost_check(shape: str, device: str, new_tokens: int) -> dict:
    """SPS profile on the device, draft block vs verify step, and peak memory of generate (CUDA)."""
    from hf_dspark import dspark_generate
    from hf_dspark.decoding.costs import draft_seconds, sps_profile, tree_draft_seconds

    target, draft = build(shape, device, torch.bfloat16 if device == "cuda" else torch.float32)
    t0 = time.perf_counter()
    profile = sps_profile(draft, target, 1)
    profile_seconds = time.perf_counter() - t0
    gamma = draft.config.num_draft_tokens
    verify_ms = {B: 1e3 / profile(B) for B in (1, 1 + gamma)}
    block_ms = 1e3 * draft_seconds(draft, 1)
    # token trees: a verify of up to 64 nodes (the scheduler's profile out to 65 slots), and a tree's drafting
    wide = sps_profile(draft, target, 1, max_width=65)
    tree_verify_ms = {B: 1e3 / wide(B) for B in (1, 9, 17, 33, 65)}
    result = {
        "sps_profile_seconds": profile_seconds, "verify_ms": verify_ms, "draft_block_ms": block_ms,
        "tree_verify_ms": tree_verify_ms, "tree4_draft_ms": 1e3 * tree_draft_seconds(draft, 4),
        "draft_block_over_one_token_step": block_ms / verify_ms[1],
        "draft_weights_mb": sum(p.numel() * p.element_size() for p in draft.parameters()) / 2**20,
    }  # fmt: skip
    if device != "cuda":
        result["peak_memory"] = skipped("no CUDA device: peak memory is read from the CUDA allocator")
        return result
    ids = prompts(1, target.config.vocab_size, device)[0]
    peaks = {}
    for name, kw in (("plain", {}), ("dspark", {"custom_generate": dspark_generate, "draft": draft})):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        target.generate(ids, max_new_tokens=new_tokens, do_sample=False, **kw)
        torch.cuda.synchronize()
        peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
    result["peak_memory"] = {"plain_mb": peaks["plain"], "dspark_mb": peaks["dspark"]}
    return result


def markdown(report: dict) -> str:
    lines = [f"# GPU check ({report['device']}, {report['date']})", "", f"shape: {report['shape']}", ""]
    kernels = report["kernels"]
    if "skipped" in kernels:
        lines.append(f"- kernels: skipped ({kernels['skipped']})")
    else:
        worst = max(r["max_abs_err"] for r in kernels["steps"])
        exact = all(r["argmax_exact"] for r in kernels["steps"])
        lines.append(f"- kernels: argmax exact {exact}, max abs error {worst:.2e}")
        for r in kernels["steps"]:
            lines.append(f"  - V={r['V']} R={r['R']}: {r['kernel_ms']:.3f} ms (reference {r['reference_ms']:.3f} "
                         f"ms, ×{r['speedup']:.1f}), W2 stream {r['w2_floor_GBps']:.0f} GB/s")  # fmt: skip
    for key in ("decode_float32", "decode_bfloat16"):
        d = report[key]
        if "skipped" in d:
            lines.append(f"- {key}: skipped ({d['skipped']})")
            continue
        same = sum(r["identical"] for r in d["prompts"])
        trees = sum(r["tree_identical"] for r in d["prompts"])
        lines.append(f"- {key}: {'OK' if d['ok'] else 'FAILED'}: {same}/{len(d['prompts'])} identical to plain "
                     f"(top-4 trees: {trees}/{len(d['prompts'])})")  # fmt: skip
        lines += [f"  - {r['difference']}" for r in d["prompts"] if r["difference"]]
    c = report["costs"]
    lines.append(f"- SPS profile measured in {c['sps_profile_seconds']:.1f} s; verify step "
                 + ", ".join(f"B={b}: {ms:.2f} ms" for b, ms in c["verify_ms"].items())
                 + f"; draft block {c['draft_block_ms']:.2f} ms ({c['draft_block_over_one_token_step']:.2f}× a "
                 f"one-token step); draft weights {c['draft_weights_mb']:.1f} MB")  # fmt: skip
    lines.append("- token trees: verify step " + ", ".join(f"B={b}: {ms:.2f} ms" for b, ms in
                 c["tree_verify_ms"].items()) + f"; a top-4 tree's drafting {c['tree4_draft_ms']:.2f} ms")  # fmt: skip
    pm = c["peak_memory"]
    if "skipped" in pm:
        lines.append(f"- peak memory: skipped ({pm['skipped']})")
    else:
        lines.append(f"- peak memory during generate: plain {pm['plain_mb']:.1f} MB, DSpark {pm['dspark_mb']:.1f} MB")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", choices=list(SHAPES), default=None, help="default: qwen3-0.6b on CUDA, tiny on CPU")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    shape = args.shape or ("qwen3-0.6b" if cuda else "tiny")
    report = {
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.machine()})", "shape": shape,
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
    }  # fmt: skip

    def section(name: str, result: dict) -> None:
        # printed as it finishes: a call cut short by its time limit still shows what ran
        report[name] = result
        print(json.dumps({name: result}, default=str), flush=True)

    if cuda:
        from benchmarks.kernels_gpu import kernel_checks

        section("kernels", {"steps": kernel_checks()})
    else:
        section("kernels", skipped("no CUDA device: Triton kernels run compiled only on a GPU"))
    section("decode_float32", decode_check(shape, device, torch.float32, args.prompts, args.max_new_tokens))
    section("decode_bfloat16", decode_check(shape, device, torch.bfloat16, args.prompts, args.max_new_tokens))
    section("costs", cost_check(shape, device, args.max_new_tokens))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    summary = markdown(report)
    (args.out / "gpu_check.md").write_text(summary)
    print(summary)
    return report


if __name__ == "__main__":
    main()
