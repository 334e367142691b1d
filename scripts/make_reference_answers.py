"""Copy the reference answers of the vendored training prompts (data/train/reference_answers.jsonl.gz).

    python scripts/make_reference_answers.py --gsm8k GSM8K_TRAIN.jsonl --codealpaca CODEALPACA.json \
        data/train/reference_answers.jsonl.gz

The prompt files in data/train keep first turns only; this file keeps what the source datasets answered them with,
for training on text the target did not write (issue #48: the target's soft labels come from one forward pass over
any text, so a row costs a forward instead of a decode). One ``{"id", "answer"}`` per line, the id the recipe's
``<file stem>:<row index>`` of the prompt it answers. GSM8K's calculator annotations (``<<48/2=24>>``) are removed
(no model writes them) and its ``#### N`` line becomes a sentence; Code Alpaca's ``output`` is kept as it is.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from pathlib import Path

CALCULATOR = re.compile(r"<<[^<>]*>>")


def gsm8k_answer(text: str) -> str:
    """GSM8K's worked solution as plain prose: annotations dropped, the final ``#### N`` line spelled out."""
    body, _, final = CALCULATOR.sub("", text).rpartition("####")
    return f"{body.rstrip()}\nThe answer is {final.strip()}." if body else text.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gsm8k", type=Path, required=True, help="GSM8K train split: {question, answer} per line")
    ap.add_argument("--codealpaca", type=Path, required=True, help="Code Alpaca JSON: a list of {..., output}")
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    rows = []
    with args.gsm8k.open() as f:
        for n, line in enumerate(f):
            rows.append({"id": f"gsm8k_train:{n}", "answer": gsm8k_answer(json.loads(line)["answer"])})
    for n, row in enumerate(json.loads(args.codealpaca.read_text())):
        rows.append({"id": f"codealpaca:{n}", "answer": row["output"].strip()})
    tmp = args.out.with_suffix(".tmp")
    with gzip.open(tmp, "wt", compresslevel=9) as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    tmp.replace(args.out)
    print(f"{len(rows)} answers -> {args.out}")


if __name__ == "__main__":
    main()
