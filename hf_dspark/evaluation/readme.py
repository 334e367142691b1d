"""Write the README's "Results" section from eval/bench JSON (numbers are never typed by hand)."""

from __future__ import annotations

import json
from pathlib import Path

from . import bench, evaluate

START, END = "<!-- results:start -->", "<!-- results:end -->"


def results_section(eval_results: list[dict], bench_results: list[dict]) -> str:
    """Markdown: the context of the runs, then the τ table and the wall-clock table."""
    runs = eval_results + bench_results
    if not runs:
        return "No measured results yet.\n"
    first = runs[0]
    lines = [
        f"Measured {first['date']} on {first['machine']}, {first['threads']} threads, {first['device']}, "
        f"{first['dtype']}; greedy unless T says otherwise; "
        + ", ".join(sorted({f"{r['dataset']}: {r['prompts']} prompts" for r in runs}))
        + ".",
        "",
    ]
    if eval_results:
        lines += [
            "**Acceptance** (τ = tokens committed per round, bonus included; verify mode "
            + ", ".join(sorted({str(r.get("verify_mode", "?")) for r in eval_results}))
            + f", γ = {eval_results[0].get('block_size', '?')})",
            "",
            evaluate.markdown_table(eval_results),
        ]
    if bench_results:
        lines += ["**Wall-clock** (interleaved, same process)", "", bench.markdown_table(bench_results)]
    return "\n".join(lines)


def write_results(readme: str | Path, eval_json: str | Path | None, bench_json: str | Path | None) -> None:
    """Replace the text between the results markers of ``readme`` (added at the end if absent)."""
    load = lambda p: json.loads(Path(p).read_text()) if p else []  # noqa: E731
    section = results_section(load(eval_json), load(bench_json))
    path = Path(readme)
    text = path.read_text()
    block = f"{START}\n{section}\n{END}"
    if START in text and END in text:
        text = text[: text.index(START)] + block + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip("\n") + f"\n\n## Results\n\n{block}\n"
    path.write_text(text)
