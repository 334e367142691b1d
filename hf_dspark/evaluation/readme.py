"""Write the README's "Results" section from eval/bench JSON (numbers are never typed by hand)."""

from __future__ import annotations

import json
from pathlib import Path

from . import bench, evaluate


def results_section(eval_results: list[dict], bench_results: list[dict]) -> str:
    """Markdown: the context of the runs, then the τ table and the wall-clock table."""
    runs = eval_results + bench_results
    if not runs:
        return "No measured results yet.\n"
    first = runs[0]
    kinds = (("τ", eval_results), ("wall-clock", bench_results))
    counts = [f"{kind}: {_prompt_counts(rs)}" for kind, rs in kinds if rs]
    lines = [
        f"Measured {first['date']} on {first['machine']}, {first['threads']} threads, {first['device']}, "
        f"{first['dtype']}; greedy unless T says otherwise; " + "; ".join(counts) + ".",
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


def _prompt_counts(results: list[dict]) -> str:
    """ "30 prompts per dataset", or "gsm8k 4, humaneval 8 prompts" when the datasets differ."""
    per = {r["dataset"]: r["prompts"] for r in results}
    if len(set(per.values())) == 1:
        return f"{next(iter(per.values()))} prompts per dataset"
    return ", ".join(f"{d} {n}" for d, n in per.items()) + " prompts"


def replace_block(readme: str | Path, name: str, body: str, heading: str = "## Results") -> None:
    """Put ``body`` between the ``<!-- name:start -->`` / ``<!-- name:end -->`` markers of ``readme``; when the
    markers are absent, append them (under ``heading``) at the end. Written atomically."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    path = Path(readme)
    text = path.read_text()
    block = f"{start}\n{body}\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip("\n") + f"\n\n{heading}\n\n{block}\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_results(readme: str | Path, eval_json: str | Path | None, bench_json: str | Path | None) -> None:
    """Replace the text between the results markers of ``readme`` (added at the end if absent)."""
    load = lambda p: json.loads(Path(p).read_text()) if p else []  # noqa: E731
    replace_block(readme, "results", results_section(load(eval_json), load(bench_json)))
