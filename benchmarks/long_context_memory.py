"""Peak memory of DSpark `generate` against plain `generate` at long prompts (CPU: process RSS; CUDA: allocator).

    python -m benchmarks.long_context_memory [--lengths 4096 16384] [--out benchmarks/results/long_context_memory]

Each measurement runs in a fresh process: a randomly initialised Llama-shaped target (no download; big enough
that a layer's hidden states over the prompt are visible), a ``from_target`` draft, one prompt of random tokens,
8 new tokens greedy. Peak = the process's high-water resident set size (``ru_maxrss``, kept by the kernel) after
`generate`, minus the resident set size just before it (loading peaks far lower); each measurement is repeated in
``--repeats`` fresh processes and the median is reported. The workers run with glibc's mmap threshold fixed at
64 KiB (``MALLOC_MMAP_THRESHOLD_``): every tensor of any size is then mapped on allocation and unmapped when freed,
so RSS follows the live tensors; with glibc's default (a threshold that grows as blocks are freed) freed blocks
linger on the heap and single runs varied by ±15%.
Methods: ``plain``; ``dspark`` (the loop as shipped: forward hooks fuse the layers the draft reads into its
[R, n, d] context input as they run); ``dspark-all-layers`` (the loop asking the target for every layer's hidden
states, as before the hooks). Goal: dspark ≤ plain + the draft's weights + its context cache + 5% of plain.
Writes ``memory.json`` and ``memory.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGET = dict(vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=12, num_attention_heads=4,
              num_key_value_heads=2, pad_token_id=0, bos_token_id=None, eos_token_id=None)  # fmt: skip
METHODS = ["plain", "dspark", "dspark-all-layers"]
WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def measure(method: str, length: int) -> dict:
    """One (method, prompt length) in this process -> peak bytes above the loaded process, and what was kept."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_dspark import DSparkDraftModel, dspark_generate
    from hf_dspark.decoding import drafting

    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(max_position_embeddings=length + 64, **TARGET)).eval()
    draft = DSparkDraftModel.from_target(target, block_size=8, head_rank=64)
    draft.decoding.verify_mode = "fixed"
    if method == "dspark-all-layers":
        drafting.LayerTap.active = property(lambda self: False)  # the loop as it was: every layer's states
    ids = torch.randint(3, TARGET["vocab_size"], (1, length), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=8, do_sample=False)
    if method != "plain":
        kw.update(custom_generate=dspark_generate, draft=draft)
    base = rss_bytes()
    if resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 > base * 1.02:
        raise RuntimeError("loading peaked above the loaded process: the high-water mark would hide generate's")
    t0 = time.perf_counter()
    with torch.no_grad():
        target.generate(ids, **kw)
    seconds = time.perf_counter() - t0
    peak = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]
    c, itemsize = draft.config, 4
    context_cache = len(draft.layers) * 2 * length * c.num_key_value_heads * c.head_dim * itemsize
    draft_weights = sum(p.numel() * p.element_size() for p in draft.parameters())  # embedding/head are borrowed
    layers = TARGET["num_hidden_layers"]
    return {
        "method": method, "prompt_tokens": length, "peak_above_loaded_mb": (peak[0] - base) / 2**20,
        "seconds": seconds, "draft_weights_mb": draft_weights / 2**20,
        "context_cache_mb": context_cache / 2**20,
        "all_hidden_states_mb": (layers + 1) * length * TARGET["hidden_size"] * itemsize / 2**20,
    }  # fmt: skip


def table(rows: list[dict]) -> str:
    by = {(r["method"], r["prompt_tokens"]): r for r in rows}
    lines = [
        "| prompt tokens | plain (MB) | DSpark (MB) | DSpark, all layers (MB) | allowance: plain + draft + context "
        "cache + 5% (MB) | DSpark within it |",
        "|---|---|---|---|---|---|",
    ]
    for length in sorted({r["prompt_tokens"] for r in rows}):
        plain, ds, old = (by.get((m, length)) for m in METHODS)
        allowance = plain["peak_above_loaded_mb"] * 1.05 + ds["draft_weights_mb"] + ds["context_cache_mb"]
        ok = "yes" if ds["peak_above_loaded_mb"] <= allowance else "NO"
        old_mb = f"{old['peak_above_loaded_mb']:.0f}" if old else "-"
        lines.append(f"| {length:,} | {plain['peak_above_loaded_mb']:.0f} | {ds['peak_above_loaded_mb']:.0f} | "
                     f"{old_mb} | {allowance:.0f} | {ok} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "long_context_memory")
    ap.add_argument("--one", nargs=2, metavar=("METHOD", "LENGTH"), help=argparse.SUPPRESS)  # a worker process
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]))))
        return
    rows = []
    for length in args.lengths:
        for method in args.methods:
            runs = []
            for _ in range(args.repeats):
                proc = subprocess.run([sys.executable, __file__, "--one", method, str(length)], capture_output=True,
                                      text=True, check=True, env={**os.environ, **WORKER_ENV})  # fmt: skip
                runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            peaks = [r["peak_above_loaded_mb"] for r in runs]
            rows.append({**runs[0], "peak_above_loaded_mb": statistics.median(peaks), "runs_mb": peaks})
            print(f"{method:>18} {length:>6}: {rows[-1]['peak_above_loaded_mb']:8.1f} MB (runs {peaks})")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory.json").write_text(json.dumps(rows, indent=1) + "\n")
    md = (f"Target: random Llama, {TARGET['num_hidden_layers']} layers, hidden {TARGET['hidden_size']}, float32, "
          "CPU; 8 new tokens greedy; peak RSS above the loaded process (median of the runs; workers with a fixed "
          "mmap threshold, see the script).\n\n" + table(rows))  # fmt: skip
    (args.out / "memory.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
