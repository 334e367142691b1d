"""Write the results page (docs/results.md) and the README's results summary from eval/bench JSON (numbers are
never typed by hand)."""

from __future__ import annotations

import json
from pathlib import Path

from hf_dspark.evaluation import bench, evaluate


def results_section(eval_results: list[dict], bench_results: list[dict]) -> str:
    """Markdown: the context of the runs, then the τ table and the wall-clock table."""
    runs = eval_results + bench_results
    if not runs:
        return "No measured results yet.\n"
    first = runs[0]
    kinds = (("τ", eval_results), ("wall-clock", bench_results))
    counts = [f"{kind}: {_prompt_counts(rs)}" for kind, rs in kinds if rs]
    dates = sorted({r["date"] for r in eval_results} | {m["date"] for m in _methods(bench_results)})
    when = dates[0] if len(dates) == 1 else " and ".join(dates) + " (per row below)"
    lines = [
        f"Measured {when} on {first['machine']}, {first['threads']} threads, {first['device']}, "
        f"{first['dtype']}; greedy unless T says otherwise; " + "; ".join(counts) + ".",
        "",
    ]
    run_dates = {m["run"]: m["date"] for m in _methods(bench_results)}
    if len(run_dates) > 1:
        lines += ["Bench runs: " + ", ".join(f"{k} measured {d}" for k, d in sorted(run_dates.items())) + ".", ""]
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


def summary_section(bench_results: list[dict]) -> str:
    """Markdown for the README: per dataset, every method of the first bench run as its speedup over plain
    ``generate`` (τ in brackets), with plain's tokens/s; the full tables live on the results page."""
    if not bench_results:
        return "No measured results yet.\n"
    first = bench_results[0]
    names = [m["method"] for m in first["methods"] if m.get("run", 1) == 1 and m["method"] != "plain"]
    lines = [
        f"Measured {first['date']} on {first['machine']}, {first['threads']} threads, {first['dtype']}, greedy, "
        f"{_prompt_counts(bench_results)}, {first.get('max_new_tokens', '?')} new tokens; speedup over plain "
        "`generate` (τ in brackets):",
        "",
        "| dataset | plain tok/s | " + " | ".join(names) + " |",
        "|---" * (len(names) + 2) + "|",
    ]
    for entry in bench_results:
        by = {m["method"]: m for m in entry["methods"] if m.get("run", 1) == 1}
        cells = []
        for name in names:
            m = by.get(name)
            tau = f" ({m['tau']:.2f})" if m and m.get("tau") is not None else ""
            cells.append(f"{m['speedup']:.2f}×{tau}" if m else "-")
        plain = by.get("plain")
        plain_cell = f"{plain['median_tok_per_s']:.1f}" if plain else "-"
        lines.append(f"| {entry['dataset']} | {plain_cell} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _methods(bench_results: list[dict]) -> list[dict]:
    """Every method row, with its run number and the date it was measured (its dataset entry's, unless merged)."""
    return [{"run": 1, "date": r["date"], **m} for r in bench_results for m in r["methods"]]


def _prompt_counts(results: list[dict]) -> str:
    """ "30 prompts per dataset", or "gsm8k 4, humaneval 8 prompts" when the datasets differ."""
    per = {r["dataset"]: r["prompts"] for r in results}
    if len(set(per.values())) == 1:
        return f"{next(iter(per.values()))} prompts per dataset"
    return ", ".join(f"{d} {n}" for d, n in per.items()) + " prompts"


def replace_block(readme: str | Path, name: str, body: str, heading: str = "## Results") -> None:
    """Put ``body`` between the ``<!-- name:start -->`` / ``<!-- name:end -->`` markers of ``readme``; when the
    markers are absent, append them (under ``heading``) at the end; a missing file is created (with its folder).
    Written atomically."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    path = Path(readme)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.is_file() else ""
    block = f"{start}\n{body}\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    else:
        text = (text.rstrip("\n") + "\n\n" if text.strip() else "") + f"{heading}\n\n{block}\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def merge_bench(runs: list[list[dict]]) -> list[dict]:
    """Several ``hf-dspark bench`` runs as one result list: per dataset (in the first run's order), the methods of
    each run in turn, each tagged with its run number (1-based). Speedups stay relative to each run's own plain
    ``generate``; a later run's plain and prompt-lookup rows are kept (as "plain (run 2)" …) so the baseline
    each ratio refers to is on the page. Runs must cover the same datasets with the same number of prompts."""
    if not runs:
        return []
    merged = []
    for entry in runs[0]:
        entry = {**entry, "methods": [{**m, "run": 1, "date": entry.get("date")} for m in entry["methods"]]}
        for k, run in enumerate(runs[1:], start=2):
            other = next((e for e in run if e["dataset"] == entry["dataset"]), None)
            if other is None or other["prompts"] != entry["prompts"]:
                raise ValueError(
                    f"bench run {k} has no {entry['dataset']!r} results with {entry['prompts']} prompts to merge"
                )
            names = {m["method"] for m in entry["methods"]}
            entry["methods"] += [
                {
                    **m,
                    "method": m["method"] + (f" (run {k})" if m["method"] in names else ""),
                    "run": k,
                    "date": other.get("date"),
                }
                for m in other["methods"]
            ]
        merged.append(entry)
    return merged


def write_results(
    page: str | Path,
    eval_json: str | Path | list[str | Path] | None,
    bench_json: str | Path | list[str | Path] | None,
    plots: str | Path | None = None,
    readme: str | Path | None = None,
) -> None:
    """Replace the text between the ``results`` markers of ``page`` (added at the end if absent) and, with
    ``readme``, its ``summary`` block. Each JSON argument may name several files (runs): eval entries are
    concatenated, bench runs merged with ``merge_bench``. With ``plots``, the acceptance, τ and speedup PNGs of the
    merged results are (re)written into that folder."""
    as_list = lambda p: [] if p is None else [p] if isinstance(p, str | Path) else list(p)  # noqa: E731
    eval_results = [r for path in as_list(eval_json) for r in json.loads(Path(path).read_text())]
    bench_results = merge_bench([json.loads(Path(path).read_text()) for path in as_list(bench_json)])
    replace_block(page, "results", results_section(eval_results, bench_results))
    if readme is not None and bench_results:
        replace_block(readme, "summary", summary_section(bench_results))
    if plots is not None:
        Path(plots).mkdir(parents=True, exist_ok=True)
        if eval_results:
            evaluate.plot_acceptance(eval_results, Path(plots) / "acceptance.png")
            evaluate.plot_tau(eval_results, Path(plots) / "tau.png")
        if bench_results:
            bench.plot_speedups(bench_results, Path(plots) / "speedup.png")
