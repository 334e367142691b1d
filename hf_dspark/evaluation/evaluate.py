"""`hf-dspark eval`: acceptance length τ, per-position conditional acceptance, verify rate and speed of a draft.

τ is the paper's metric: tokens committed per verification round, the bonus/correction token included. The
conditional acceptance at position k is P(draft token k accepted | tokens 1..k-1 accepted and k was verified).
A malformed line in a prompt file stops the run with ``file:line`` in the message (no silent skipping).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from ..decoding.stats import DSparkStats
from ..integration.generate import dspark_generate
from ..plotting import pyplot

DATASETS = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")


def eval_dir() -> Path:
    """Where the named datasets live: the prompt files shipped in the package (``hf_dspark/data/eval/``)."""
    return Path(__file__).resolve().parents[1] / "data" / "eval"


def chat_ids(tokenizer, text: str) -> torch.Tensor:
    """``text`` as one user turn through the tokenizer's chat template, ready for the assistant: -> ids [1, T]."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt"
    )["input_ids"]


def load_prompts(dataset: str, limit: int | None = None, turn: int = 0) -> list[str]:
    """First-turn (or ``turn``) prompts from a dataset name in :data:`DATASETS` or a ``{"turns": [...]}`` JSONL path."""
    path = Path(dataset)
    if not path.suffix:
        if dataset not in DATASETS:
            raise ValueError(f"unknown dataset {dataset!r}: use one of {DATASETS} or a path to a .jsonl file")
        path = eval_dir() / f"{dataset}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    prompts = []
    for n, line in enumerate(path.read_text().split("\n"), 1):
        if not line.strip():
            continue
        try:
            turns = json.loads(line)["turns"]
            prompts.append(turns[turn])
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
            raise ValueError(f"{path}:{n}: malformed prompt line ({type(e).__name__}: {e})") from None
        if limit is not None and len(prompts) >= limit:
            break
    return prompts


def run_context(target) -> dict:
    """Where and when a measurement ran: machine, threads, device, dtype, date (kept with every result)."""
    import platform

    return {
        "machine": f"{platform.machine()} {os.cpu_count()} cores ({platform.system()})",
        "threads": torch.get_num_threads(),
        "device": str(target.device),
        "dtype": str(target.dtype).replace("torch.", ""),
        "date": time.strftime("%Y-%m-%d"),
    }


def summarize(stats: list[DSparkStats], seconds: float = 0.0, new_tokens: int = 0) -> dict:
    """Aggregate per-prompt stats: τ over all rounds, per-position conditional acceptance, verify rate."""
    merged = DSparkStats(num_draft_tokens=stats[0].num_draft_tokens if stats else 0)
    for s in stats:
        merged.proposed += s.proposed
        merged.accepted += s.accepted
        merged.committed += s.committed
        merged.depths += s.depths
    proposed = sum(merged.proposed)
    return {
        "prompts": len(stats),
        "rounds": merged.rounds,
        "tau": merged.tau,
        "position_acceptance": merged.position_acceptance(),
        "verify_rate": sum(merged.accepted) / proposed if proposed else None,
        "mean_verified": proposed / merged.rounds if merged.rounds else 0.0,
        "tokens_per_s": new_tokens / seconds if seconds > 0 else None,
    }


@torch.no_grad()
def evaluate(
    target,
    tokenizer,
    draft,
    dataset: str,
    limit: int | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    label: str = "dspark",
    progress: bool = True,
    settings: dict | None = None,
) -> dict:
    """Run DSpark generation over ``dataset`` and return :func:`summarize` plus the settings (``label`` names the
    draft in tables and plots). ``settings``: this run's decoding settings (``DecodingConfig`` fields; the rest are
    the draft's own, which are never changed); lookup drafting is off unless ``settings`` turns it on
    (``lookup_max_ngram``), so the draft alone is measured whatever its saved settings say."""
    prompts = load_prompts(dataset, limit)
    settings = {"lookup_max_ngram": 0, **(settings or {})}
    result = _evaluate(target, tokenizer, draft, prompts, dataset, max_new_tokens, temperature, progress, settings)
    result.update(draft=label, dataset=dataset, max_new_tokens=max_new_tokens, temperature=temperature,
                  verify_mode=settings.get("verify_mode") or draft.decoding.verify_mode,
                  block_size=draft.config.block_size, lookup_max_ngram=settings["lookup_max_ngram"],
                  **run_context(target))  # fmt: skip
    return result


def _evaluate(target, tokenizer, draft, prompts, dataset, max_new_tokens, temperature, progress, settings) -> dict:
    """The generation loop of :func:`evaluate`: -> :func:`summarize` over the prompts."""
    from tqdm.auto import tqdm

    all_stats, seconds, tokens = [], 0.0, 0
    for text in tqdm(prompts, desc=f"eval {dataset}", disable=not progress):
        ids = chat_ids(tokenizer, text)
        kw = dict(max_new_tokens=max_new_tokens, do_sample=temperature > 0)
        if temperature > 0:
            kw["temperature"] = temperature
        t0 = time.perf_counter()
        out = target.generate(ids, custom_generate=dspark_generate, draft=draft, **settings, **kw)
        seconds += time.perf_counter() - t0
        tokens += out.shape[1] - ids.shape[1]
        all_stats.append(draft.stats)
    return summarize(all_stats, seconds, tokens)


def markdown_table(results: list[dict]) -> str:
    """One row per draft and dataset: τ, verify rate, tokens/s and the per-position acceptance curve (and the
    date each row was measured, when the rows come from runs on different days)."""
    dated = len({r.get("date") for r in results}) > 1
    lines = [
        "| draft | dataset | T | prompts | τ | verify rate | tok/s | acceptance by position |"
        + (" measured |" if dated else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|" if dated else ""),
    ]
    for r in results:
        curve = " ".join("-" if a is None else f"{a:.2f}" for a in r["position_acceptance"])
        rate = "-" if r["verify_rate"] is None else f"{r['verify_rate']:.2f}"
        tps = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.1f}"
        cells = [r.get("draft", "dspark"), r["dataset"], r["temperature"], r["prompts"], f"{r['tau']:.2f}", rate, tps]
        lines.append("| " + " | ".join(str(c) for c in [*cells, curve] + ([r.get("date")] if dated else [])) + " |")
    return "\n".join(lines) + "\n"


def plot_acceptance(results: list[dict], path: str | Path) -> Path | None:
    """Per-position conditional acceptance curves (PNG): one line per draft, dataset and temperature; a colour per
    dataset and temperature, a line style per draft, so a draft and its ablation read side by side."""
    plt = pyplot(path)
    if plt is None:
        return None

    fig, ax = plt.subplots(figsize=(7, 4.5))
    drafts = list(dict.fromkeys(r.get("draft", "dspark") for r in results))
    series = list(dict.fromkeys((r["dataset"], r["temperature"]) for r in results))
    styles = ["-", "--", ":", "-."]
    for r in results:
        d = r.get("draft", "dspark")
        ys = [float("nan") if a is None else a for a in r["position_acceptance"]]
        ax.plot(range(1, len(ys) + 1), ys, marker="o", ms=3, linestyle=styles[drafts.index(d) % len(styles)],
                color=f"C{series.index((r['dataset'], r['temperature'])) % 10}",
                label=f"{d}: {r['dataset']} T={r['temperature']}")  # fmt: skip
    ax.set_xlabel("block position k")
    ax.set_ylabel("P(accept k | 1..k-1 accepted)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_tau(results: list[dict], path: str | Path) -> Path | None:
    """Grouped bars of τ (PNG): one group per dataset, one bar per draft and temperature."""
    plt = pyplot(path)
    if plt is None:
        return None

    datasets = list(dict.fromkeys(r["dataset"] for r in results))
    series = list(dict.fromkeys((r.get("draft", "dspark"), r["temperature"]) for r in results))
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(datasets) * len(series)), 4))
    for j, (draft, temperature) in enumerate(series):
        taus = {
            r["dataset"]: r["tau"]
            for r in results
            if (r.get("draft", "dspark"), r["temperature"]) == (draft, temperature)
        }
        xs = [i + j * width for i, d in enumerate(datasets) if d in taus]
        ax.bar(xs, [taus[d] for d in datasets if d in taus], width, label=f"{draft} T={temperature}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(datasets))], datasets)
    ax.set_ylabel("τ (tokens per round, bonus included)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
