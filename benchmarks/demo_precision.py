"""Which precision should the demo open in? Its example prompts, run as the demo runs them (greedy, 128 new tokens,
the shipped draft's defaults: scheduled verify with lookup drafting), in bfloat16 and in float32 on this CPU.

For each precision and example: plain ``generate`` and DSpark, alternated ``--repeats`` times (both precisions'
models loaded side by side, every pair run back to back so a slow spell of the host hits both), the speedup (median
of the per-repeat ratios), tokens/s, and whether DSpark's output is plain greedy's token for token. Writes
``demo_precision.json`` and ``demo_precision.md`` under ``--out``.

    python -m benchmarks.demo_precision --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from hf_dspark.demo.app import EXAMPLES

from hf_dspark import DSparkDraftModel, dspark_generate, embedded
from hf_dspark.evaluation.bench import warm_up
from hf_dspark.evaluation.evaluate import chat_ids


def timed(target, ids: torch.Tensor, **kw) -> tuple[torch.Tensor, float]:
    """(target.generate(ids, **kw), its wall seconds)."""
    start = time.perf_counter()
    out = target.generate(ids, **kw)
    return out, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--examples", type=int, default=len(EXAMPLES), help="the first N example prompts")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/demo_precision"))
    args = ap.parse_args()
    pairs = {}
    for dtype in (torch.bfloat16, torch.float32):
        target, tokenizer = embedded.load_target(dtype)
        draft = DSparkDraftModel.from_pretrained(embedded.DRAFT_DIR).attach(target)
        warm_up(target, draft, chat_ids(tokenizer, "Hi"))
        pairs[str(dtype).removeprefix("torch.")] = (target, draft)
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    rows = []
    for i, text in enumerate(EXAMPLES[: args.examples]):
        ids = chat_ids(tokenizer, text)
        runs = {name: {"plain": [], "dspark": [], "identical": None, "tokens": 0, "tau": 0.0} for name in pairs}
        for _ in range(args.repeats):
            for name, (target, draft) in pairs.items():
                ref, plain_s = timed(target, ids, **kw)
                out, fast_s = timed(target, ids, custom_generate=dspark_generate, draft=draft, **kw)
                run = runs[name]
                run["plain"].append(plain_s)
                run["dspark"].append(fast_s)
                run["identical"] = torch.equal(out, ref) if run["identical"] is None else run["identical"]
                run["tokens"], run["tau"] = ref.shape[1] - ids.shape[1], draft.stats.tau
        for name, run in runs.items():
            ratios = [p / f for p, f in zip(run["plain"], run["dspark"], strict=True)]
            rows.append({
                "example": i, "prompt": text[:60], "dtype": name, "tokens": run["tokens"],
                "plain_tok_s": round(run["tokens"] / statistics.median(run["plain"]), 1),
                "dspark_tok_s": round(run["tokens"] / statistics.median(run["dspark"]), 1),
                "speedup": round(statistics.median(ratios), 3), "tau": round(run["tau"], 2),
                "identical": run["identical"], "plain_s": run["plain"], "dspark_s": run["dspark"],
            })  # fmt: skip
            print(json.dumps({k: v for k, v in rows[-1].items() if not k.endswith("_s")}), flush=True)
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')}, {torch.get_num_threads()} threads, greedy, {args.max_new_tokens} "
        f"new tokens, the shipped draft's defaults, median of {args.repeats} alternated repeats:",
        "",
        "| example | dtype | plain tok/s | DSpark tok/s | speedup | τ | identical to plain greedy |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['example']}: {r['prompt']}… | {r['dtype']} | {r['plain_tok_s']} | {r['dspark_tok_s']} | "
                     f"{r['speedup']:.2f}× | {r['tau']:.2f} | {'yes' if r['identical'] else 'no'} |")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "demo_precision.json").write_text(json.dumps({"repeats": args.repeats, "rows": rows}, indent=1))
    (args.out / "demo_precision.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
