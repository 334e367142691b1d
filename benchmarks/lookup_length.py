"""How long a lookup continuation should be: the shipped configuration at several ``lookup_max_tokens``.

    python -m benchmarks.lookup_length [--tokens 8 12 16 24] [--adaptive 24] [--per-source 10] [--threads 2]
        [--sources ...] [--eval-sets humaneval gsm8k mt-bench --limit 15] [--out benchmarks/results/lookup_length]

The shipped draft as shipped (scheduled, lookup drafting over n-grams of 3..2 tokens) with each lookup cap, beside
plain ``generate`` and transformers' prompt lookup (10 tokens), interleaved prompt by prompt (``hf-dspark bench``'s
loop: greedy, bfloat16 where the CPU has bf16 units, 128 new tokens, every output checked against plain greedy).
Prompts: the recipe's held-out training prompts, ``--per-source`` of each source (never trained on, and not the eval
sets, so a cap chosen here is not fitted to the numbers the README reports). Prints a table per source and writes
``<out>/lookup_length.json``. ``--adaptive K``: also the cap K with ``lookup_adaptive`` (lookups start at γ and
double while accepted in full), named ``lookupKa``. ``--eval-sets``: run on the first ``--limit`` prompts of these
shipped eval sets instead, to confirm a cap chosen on the held-out prompts.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from hf_dspark import DSparkDraftModel, dspark_generate
from hf_dspark.embedded import DRAFT_DIR, fast_dtype, load_target
from hf_dspark.evaluation.bench import Method, bench, markdown_table
from recipes.smollm2_prepare import recipe_prompts
from recipes.smollm2_train import is_held_out

ROOT = Path(__file__).resolve().parents[1]


def capped(target, draft, tokens: int | None, adaptive: bool = False) -> Method:
    """The draft's own settings with lookups of at most ``tokens`` (``None``: γ), grown from γ when ``adaptive``
    (per call: the methods share the draft object)."""
    settings = {"lookup_max_tokens": tokens or draft.config.num_draft_tokens, "lookup_adaptive": adaptive}

    def run(ids, **kw):
        return target.generate(ids, custom_generate=dspark_generate, draft=draft, **settings, **kw)

    return Method(f"lookup{tokens or draft.config.num_draft_tokens}{'a' if adaptive else ''}", run, draft)


def held_out_texts(per_source: int) -> dict[str, list[str]]:
    """The first ``per_source`` held-out single-turn prompts of each training source, as text."""
    texts: dict[str, list[str]] = {}
    for p in recipe_prompts():
        if is_held_out({"id": p.id}) and len(texts.setdefault(p.source, [])) < per_source:
            texts[p.source].append(p.messages[0]["content"])
    return texts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 12, 16, 24])
    ap.add_argument("--adaptive", type=int, nargs="*", default=[], metavar="K")
    ap.add_argument("--per-source", type=int, default=10)
    ap.add_argument("--sources", nargs="*", default=None, help="the training sources to use (default: all)")
    ap.add_argument("--eval-sets", nargs="*", default=None, help="shipped eval sets to run instead (e.g. gsm8k)")
    ap.add_argument("--limit", type=int, default=15, help="prompts per eval set (with --eval-sets)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft", type=Path, default=DRAFT_DIR)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "lookup_length")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = fast_dtype()
    target, tokenizer = load_target(dtype)
    draft = DSparkDraftModel.from_pretrained(args.draft).attach(target).eval()
    if not draft.decoding.lookup_max_ngram:
        raise SystemExit(f"{args.draft} has lookup drafting off: nothing to measure")
    methods = [
        Method("plain", lambda ids, **kw: target.generate(ids, **kw)),
        Method(
            "prompt-lookup", lambda ids, **kw: target.generate(ids, prompt_lookup_num_tokens=10, **kw), baseline=True
        ),
        *[capped(target, draft, k) for k in args.tokens],
        *[capped(target, draft, k, adaptive=True) for k in args.adaptive],
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    setting = {
        "draft": str(args.draft),
        "tokens": args.tokens,
        "adaptive": args.adaptive,
        "per_source": args.per_source,
        "eval_sets": args.eval_sets,
        "limit": args.limit if args.eval_sets else None,
        "dtype": str(dtype).removeprefix("torch."),
        "threads": args.threads,
    }
    results = []

    def measure(dataset: str, name: str, limit: int | None = None) -> None:
        result = bench(target, tokenizer, methods, dataset, limit=limit, max_new_tokens=args.max_new_tokens)
        results.append(result | {"dataset": name})
        print(markdown_table(results[-1:]), flush=True)
        # written after every set, so a run stopped by a failing one keeps what it measured
        (args.out / "lookup_length.json").write_text(json.dumps({"setting": setting, "results": results}, indent=1))

    if args.eval_sets:
        for name in args.eval_sets:
            measure(name, name, args.limit)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for source, texts in held_out_texts(args.per_source).items():
                if args.sources is not None and source not in args.sources:
                    continue
                path = Path(tmp) / f"{source}.jsonl"
                path.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in texts))
                measure(str(path), source)
    print(markdown_table(results))


if __name__ == "__main__":
    main()
