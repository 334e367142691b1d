"""Build function-completion prompts (data/train/codealpaca_functions.jsonl.gz) from a Code Alpaca JSON file.

    python scripts/make_function_prompts.py SOURCE.json data/train/codealpaca_functions.jsonl.gz

Code Alpaca asks for code in prose ("Write a Python function that ..."); benchmark-style code prompts instead give
a function's signature and docstring and ask for the rest, so the answer restates code the prompt already holds.
For every row whose reference solution (``output``) parses as Python and defines a top-level function, this writes
one prompt of that second kind: the solution's imports and the function's signature (decorators included), with
the row's instruction (and its example input) as the docstring, and no body. The solution itself is dropped, like
every answer in data/train: the target regenerates its own. A prompt's id is the source row's index, so
``codealpaca_functions:N`` and ``codealpaca:N`` come from the same row.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import textwrap
from pathlib import Path

INSTRUCTION = "Complete the Python function below so that it does what its docstring says."


def function_prompt(instruction: str, example: str, solution: str) -> str | None:
    """The function-completion prompt for one row, or ``None`` when ``solution`` is not Python defining a
    top-level function whose body starts on a line of its own."""
    try:
        tree = ast.parse(solution)
    except SyntaxError:
        return None
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)), None)
    if fn is None or fn.body[0].lineno == fn.lineno:
        return None
    lines = solution.splitlines()
    first = min([fn.lineno, *(d.lineno for d in fn.decorator_list)]) - 1
    header = lines[first : fn.body[0].lineno - 1]  # the signature, up to the body (or the solution's docstring)
    imports = [line for line in lines if line.startswith(("import ", "from "))]
    doc = instruction.strip() + (f"\nExample input: {example.strip()}" if example.strip() else "")
    docstring = textwrap.indent(f'"""{doc}\n"""', "    ")
    code = "\n".join([*imports, *([""] if imports else []), *header, docstring])
    return f"{INSTRUCTION}\n```python\n{code}\n```"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("source", type=Path, help="Code Alpaca JSON: a list of {instruction, input, output}")
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    rows = json.loads(args.source.read_text())
    kept = []
    for i, row in enumerate(rows):
        prompt = function_prompt(row["instruction"], row.get("input", ""), row["output"])
        if prompt is not None:
            kept.append({"id": str(i), "turns": [prompt]})
    text = "".join(json.dumps(r) + "\n" for r in kept)
    args.out.write_bytes(gzip.compress(text.encode(), mtime=0))  # mtime 0: the same bytes on every build
    print(f"{len(kept)} function-completion prompts of {len(rows)} rows -> {args.out}")


if __name__ == "__main__":
    main()
