"""Regenerate the training answers for the shipped SmolLM2 draft (resumable; run it again to continue).

python recipes/smollm2_prepare.py [--out ~/.cache/hf_dspark/smollm2/train.jsonl] [--threads 1] [--dtype float32]

``--dtype bfloat16`` answers faster on a CPU with native bf16 units (see embedded.fast_dtype); the answers are sampled
(T = 0.7), and the two dtypes' distributions differ only by rounding, so a file may mix them.
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
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sources = {name: read_prompts(next(args.data.glob(name + ".json*"))) for name in COUNTS}
    prompts = mix_prompts(sources, COUNTS, seed=0)
    target, tokenizer = load_target(getattr(torch, args.dtype))
    regenerate(target, tokenizer, prompts, args.out, max_new_tokens=args.max_new_tokens)


if __name__ == "__main__":
    main()
