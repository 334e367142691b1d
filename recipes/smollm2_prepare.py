"""Regenerate the training answers for the shipped SmolLM2 draft (resumable; run it again to continue).

python recipes/smollm2_prepare.py [--data FILE ...] [--out data/train/answers-smollm2] [--threads 1]
                                  [--dtype bfloat16]

Prompts: the three prompt files vendored in ``data/train/`` (see its README for their origin and licences), or the
files given with ``--data`` (any format ``hf_dspark.training.data.read_prompts`` reads). The shuffled mix keeps the
paper's proportions (~18% chat, ~39% math, ~39% code); after it come ``EXTRA`` more chat prompts (the ShareGPT
prompts the mix left out), appended rather than mixed in so that the answers already regenerated stay a prefix.

Answers go to a shard folder inside the repository: sealed ``answers-NNNNN.jsonl.gz`` shards of 250 rows are never
rewritten, so they can be committed as they come and a fresh clone on another machine resumes from them (only the
ignored ``open.jsonl``, fewer than 250 rows, is lost with a machine; once every prompt is answered, its rows become
one last, shorter shard). The answers are sampled (T = 0.7), and
float32 and bfloat16 differ only by rounding, so a folder may mix them.
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
# Chat prompts answered after the mix: mt-bench is the set where the draft trails most (τ 1.42 vs 1.73 / 2.18).
EXTRA = {"sharegpt_prompts": 1500}
SHARD_ROWS = 250  # ~65 KB gzipped: small commits, and little lost with a machine


def recipe_prompts(files: list[Path] | None = None) -> list:
    """The recipe's prompts in answer order (``hf_dspark.training.data.Prompt`` list) from ``files`` (default:
    vendored): the shuffled mix, then the ``EXTRA`` prompts drawn from what the mix left of each source."""
    files = files or [PROMPTS / f"{name}.jsonl.gz" for name in COUNTS]
    sources = {path.name.split(".")[0]: read_prompts(path) for path in files}
    counts = {name: COUNTS.get(name, len(prompts)) for name, prompts in sources.items()}
    mix = mix_prompts(sources, counts, seed=0)
    taken = {p.id for p in mix}
    rest = {name: [p for p in sources[name] if p.id not in taken] for name in EXTRA if name in sources}
    return mix + mix_prompts(rest, EXTRA, seed=1)


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
