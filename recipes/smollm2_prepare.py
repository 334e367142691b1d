"""Regenerate the training answers for the shipped SmolLM2 draft (resumable; run it again to continue).

python -m recipes.smollm2_prepare [--data FILE ...] [--out data/train/answers-smollm2] [--threads 1]
                                  [--dtype bfloat16]

Prompts: the three prompt files vendored in ``data/train/`` (see its README for their origin and licences), or the
files given with ``--data`` (any format ``hf_dspark.training.data.read_prompts`` reads). The shuffled mix keeps the
paper's proportions (~18% chat, ~39% math, ~39% code); after it come the ``EXTRAS`` stages, each drawn from what the
mix and earlier stages left (1,500 more ShareGPT chat prompts, the rest of Code Alpaca, function completions, then
3,000 more chat prompts), appended rather than mixed in so that the answers already regenerated stay a prefix.

Answers go to a shard folder inside the repository: sealed ``answers-NNNNN.jsonl.gz`` shards of 250 rows are never
rewritten, so they can be committed as they come and a fresh clone on another machine resumes from them (only the
ignored ``open.jsonl``, fewer than 250 rows, is lost with a machine; once every prompt is answered, its rows become
one last, shorter shard). The answers are sampled (T = 0.7), and float32 and bfloat16 differ only by rounding, so a
folder may mix them.
"""

import argparse
from pathlib import Path

import torch

from hf_dspark.embedded import load_target
from hf_dspark.training.data import mix_prompts, read_prompts, regenerate, seal_shards

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "data" / "train"
ANSWERS = PROMPTS / "answers-smollm2"
# How many prompts the mix takes from each source (by file name before its first dot).
COUNTS = {"gsm8k_train": 2400, "codealpaca": 2400, "sharegpt_prompts": 1100}
# Stages answered after the mix, in order: chat first (mt-bench is where the draft trailed most, τ 1.42 against
# 1.73 / 2.18), then every Code Alpaca prompt the mix left (humaneval is the furthest from its goal, 1.73 vs 2.2),
# then function-completion prompts built from Code Alpaca's Python solutions (scripts/make_function_prompts.py: a
# signature and docstring to complete, the shape of benchmark code prompts, where the draft's τ is lower), then
# 3,000 more chat prompts (the three-layer draft trained on the rest met its τ goal on gsm8k, not on mt-bench: 1.49
# against 1.6, the one set where it and lookup together do not beat prompt lookup alone), then every prompt left:
# the rest of GSM8K's train split and of ShareGPT (issue #48: more tokens; answered on a borrowed GPU first).
EXTRAS = [{"sharegpt_prompts": 1500}, {"codealpaca": 2135}, {"codealpaca_functions": 820}, {"sharegpt_prompts": 3000},
          {"gsm8k_train": 5073, "sharegpt_prompts": 8796}]  # fmt: skip
SHARD_ROWS = 250  # ~65 KB gzipped: small commits, and little lost with a machine


def recipe_prompts(files: list[Path] | None = None) -> list:
    """The recipe's prompts in answer order (``hf_dspark.training.data.Prompt`` list) from ``files`` (default:
    vendored): the shuffled mix, then each ``EXTRAS`` stage (seed 1, 2, ...) drawn from what came before left."""
    staged = {name for stage in EXTRAS for name in stage if name not in COUNTS}  # sources of later stages only
    files = files or [PROMPTS / f"{name}.jsonl.gz" for name in [*COUNTS, *sorted(staged)]]
    sources = {path.name.split(".")[0]: read_prompts(path) for path in files}
    in_mix = {name: prompts for name, prompts in sources.items() if name not in staged}
    order = mix_prompts(in_mix, {name: COUNTS.get(name, len(prompts)) for name, prompts in in_mix.items()}, seed=0)
    for seed, stage in enumerate(EXTRAS, start=1):
        taken = {p.id for p in order}
        rest = {name: [p for p in sources[name] if p.id not in taken] for name in stage if name in sources}
        order += mix_prompts(rest, stage, seed=seed)
    return order


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, nargs="+", help="prompt files (default: the vendored data/train/*.jsonl.gz)")
    ap.add_argument("--out", type=Path, default=ANSWERS)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = recipe_prompts(args.data)
    target, tokenizer = load_target(getattr(torch, args.dtype))
    regenerate(target, tokenizer, prompts, args.out, max_new_tokens=args.max_new_tokens, shard_rows=SHARD_ROWS)
    # every prompt is answered: the rest of the open file becomes a last shard, committed like the others
    seal_shards(args.out, SHARD_ROWS, final=True)


if __name__ == "__main__":
    main()
