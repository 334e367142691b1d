"""Maintainer tool: write this repository's results page and README summary from eval/bench JSON.

    python scripts/write_results.py --eval RESULTS/eval.json --bench RESULTS/bench.json

It rewrites the results block of ``docs/results.md`` and the summary block of ``README.md`` *of this repository*
(found from this file, never from the current folder); ``--out``/``--readme`` point it elsewhere, and a missing
``--out`` file is created.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the repository's benchmarks/ holds the table writers

from benchmarks.readme_tables import write_results  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eval", nargs="+", default=None, help="eval.json file(s) from `hf-dspark eval` (concatenated)")
    ap.add_argument(
        "--bench", nargs="+", default=None,
        help="bench.json file(s) from `hf-dspark bench` (several runs are merged; ratios stay per run)",
    )  # fmt: skip
    ap.add_argument("--plots", default=None, help="also write acceptance/tau/speedup PNGs of the merged results here")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results.md"),
                    help="the results page whose results block is rewritten (default: %(default)s)")  # fmt: skip
    ap.add_argument(
        "--readme", default=str(ROOT / "README.md"),
        help="whose summary block is rewritten; 'none' leaves every README alone (default: %(default)s)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    readme = None if args.readme in ("", "none") else args.readme
    write_results(args.out, args.eval, args.bench, plots=args.plots, readme=readme)
    print(f"updated the results in {args.out}" + (f" and the summary in {readme}" if readme else ""))


if __name__ == "__main__":
    main()
