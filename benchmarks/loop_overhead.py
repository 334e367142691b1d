"""Per-round cost of the decoding loop's own Python, on a target so tiny that its math is negligible.

    python -m benchmarks.loop_overhead [--out benchmarks/results/loop_overhead.json]

A 2-layer, 32-wide random Llama target and a 1-layer draft (γ = 4), greedy, fixed verification (every round
drafts and verifies, no timing-dependent plan), 1 thread: the time per round is what the loop itself costs.
Reported beside it: the same prompts through plain ``generate`` (time per token), and the loop's line count, so a
refactor of the loop can show both before and after (run it on each commit, e.g. from a ``git worktree`` of the
older one with ``PYTHONPATH`` pointing at it, back to back with the newer).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_dspark import DSparkDraftModel, dspark_generate
from hf_dspark.decoding import loop


def loop_lines() -> dict:
    """Lines of the decode loop (the public entry point and, on commits that had one, the body it delegated to),
    and of the longest function or method in ``hf_dspark/decoding/loop.py``."""
    names = [n for n in ("dspark_decode", "_decode") if hasattr(loop, n)]
    loop_total = sum(len(inspect.getsource(getattr(loop, n)).splitlines()) for n in names)
    candidates = list(vars(loop).values())
    for cls in vars(loop).values():
        if inspect.isclass(cls) and cls.__module__ == loop.__name__:
            candidates += [getattr(f, "__func__", f) for f in vars(cls).values()]
    candidates = [inspect.unwrap(f) if callable(f) else f for f in candidates]  # torch.no_grad wraps the loop
    source_file = inspect.getsourcefile(loop)
    functions = [f for f in candidates if inspect.isfunction(f) and f.__code__.co_filename == source_file]
    longest = max(functions, key=lambda f: len(inspect.getsource(f).splitlines()))
    return {"loop_lines": loop_total, "longest_function": longest.__qualname__,
            "longest_function_lines": len(inspect.getsource(longest).splitlines())}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "loop_overhead.json")
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=None,
                         eos_token_id=None)  # fmt: skip
    target = LlamaForCausalLM(config).eval()
    draft = DSparkDraftModel.from_target(target, block_size=4, num_draft_layers=1, head_rank=8)
    draft.decoding.verify_mode = "fixed"
    prompts = [torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(i)) for i in range(args.calls)]
    kw = dict(max_new_tokens=64, do_sample=False)
    per_round, per_token = [], []
    for ids in prompts[:3]:  # warm-up
        target.generate(ids, custom_generate=dspark_generate, draft=draft, **kw)
    for ids in prompts:
        t0 = time.perf_counter()
        target.generate(ids, custom_generate=dspark_generate, draft=draft, **kw)
        per_round.append((time.perf_counter() - t0) / draft.stats.rounds)
        t0 = time.perf_counter()
        out = target.generate(ids, **kw)
        per_token.append((time.perf_counter() - t0) / (out.shape[1] - ids.shape[1]))
    result = {
        "round_ms_median": 1e3 * statistics.median(per_round),
        "plain_token_ms_median": 1e3 * statistics.median(per_token),
        **loop_lines(),
        "calls": args.calls, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
