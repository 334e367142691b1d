"""Regenerate the training answers for the shipped SmolLM2 draft (resumable; run it again to continue).

python recipes/smollm2_prepare.py [--out ~/.cache/hf_dspark/smollm2/train.jsonl] [--threads 1]
"""

import argparse
import os
from pathlib import Path

import torch

from hf_dspark.embedded import load_target
from hf_dspark.training.data import mix_prompts, read_prompts, regenerate

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "train"
# The paper's mix is ~18% chat, ~39% math, ~39% code; a prefix of the shuffled list keeps that mix.
COUNTS = {"gsm8k_train": 2400, "codealpaca": 2400, "sharegpt_prompts": 1100}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=Path(os.environ.get("HF_DSPARK_DATA", DATA)))
    ap.add_argument("--out", type=Path, default=Path("~/.cache/hf_dspark/smollm2/train.jsonl").expanduser())
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sources = {name: read_prompts(next(args.data.glob(name + ".json*"))) for name in COUNTS}
    prompts = mix_prompts(sources, COUNTS, seed=0)
    target, tokenizer = load_target()
    regenerate(target, tokenizer, prompts, args.out, max_new_tokens=args.max_new_tokens)


if __name__ == "__main__":
    main()
