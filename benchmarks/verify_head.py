"""The verify's LM head in F.linear's orientation against the transposed one, side by side
(``hf_dspark/decoding/lm_head.py``).

    python -m benchmarks.verify_head [--datasets humaneval gsm8k mt-bench] [--limit 10] [--threads 2]
        [--out benchmarks/results/verify_head]

First the micro-benchmark behind the choice (the head's matmul at 1..17 rows, both ways), then the target's verify
steps per second at B = 1..9 both ways, then the shipped configuration (draft + lookups, scheduled) decoding the
first ``--limit`` prompts of each set with the head forced to each orientation (each with its own SPS profile,
measured under it), interleaved with plain ``generate`` (``hf-dspark bench``'s loop: greedy, 128 new tokens, every
output checked against plain greedy), in the dtype ``fast_dtype()`` picks on this machine. Writes
``<out>/verify_head.json`` and prints the tables.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from hf_dspark import DSparkDraftModel
from hf_dspark.decoding import lm_head
from hf_dspark.decoding.costs import measure_sps, time_verify_steps
from hf_dspark.embedded import DRAFT_DIR, fast_dtype, load_target
from hf_dspark.evaluation.bench import Method, bench, markdown_table

ROOT = Path(__file__).resolve().parents[1]


def forced(transposed: bool) -> None:
    lm_head.transposed_pays = lambda weight: transposed


def matmul_table(weight: torch.Tensor, rows=(1, 2, 3, 5, 9, 17), reps: int = 20) -> list[dict]:
    """Milliseconds of the head's matmul at each row count, F.linear and transposed (median of ``reps``)."""
    table = []
    for m in rows:
        x = torch.randn(m, weight.shape[1]).to(weight.dtype)
        ms = {}
        for name, fn in (("linear", F.linear), ("transposed", lm_head.few_rows_linear)):
            ms[name] = 1e3 * lm_head._median_seconds(functools.partial(fn, x, weight), reps)  # the choice's timer
        table.append({"rows": m, **ms})
    return table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--datasets", nargs="+", default=["humaneval", "gsm8k", "mt-bench"])
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "verify_head")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = fast_dtype()
    target, tokenizer = load_target(dtype)
    head = target.get_output_embeddings()
    measured = lm_head.head_orientation(target)  # what the library picks here, before anything is forced
    matmul = matmul_table(head.weight.detach())
    print("| rows | F.linear ms | transposed ms |\n|---|---|---|")
    for row in matmul:
        print(f"| {row['rows']} | {row['linear']:.2f} | {row['transposed']:.2f} |")
    steps, drafts = {}, {}
    for name in ("linear", "transposed"):
        forced(name == "transposed")
        with torch.no_grad():
            seconds = time_verify_steps(target, list(range(1, 10)), reps=5)
        steps[name] = {B: 1 / s for B, s in seconds.items()}
        drafts[name] = measure_sps(DSparkDraftModel.from_pretrained(DRAFT_DIR).attach(target).eval(), 1)
    print("| B | steps/s, F.linear | steps/s, transposed |\n|---|---|---|")
    for B in steps["linear"]:
        print(f"| {B} | {steps['linear'][B]:.1f} | {steps['transposed'][B]:.1f} |")

    def run_with(name: str) -> Method:
        def run(ids, **kw):
            forced(name == "transposed")
            return target.generate(ids, assistant_model=drafts[name], **kw)

        return Method(f"shipped-{name}", run, drafts[name])

    plain = Method("plain", lambda ids, **kw: target.generate(ids, **kw))
    methods = [plain, run_with("linear"), run_with("transposed")]
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for dataset in args.datasets:
        results.append(bench(target, tokenizer, methods, dataset, limit=args.limit, max_new_tokens=args.max_new_tokens))
        print(markdown_table(results[-1:]), flush=True)
        record = {
            "dtype": str(dtype).removeprefix("torch."),
            "threads": args.threads,
            "library_choice": measured,
            "matmul_ms": matmul,
            "verify_steps_per_s": steps,
            "results": results,
        }
        (args.out / "verify_head.json").write_text(json.dumps(record, indent=1))
    print(markdown_table(results))


if __name__ == "__main__":
    main()
