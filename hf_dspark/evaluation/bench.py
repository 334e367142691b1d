"""`hf-dspark bench`: wall-clock comparison against what users would run instead, in one process.

Every prompt runs every method back to back (A B C … per prompt, the order rotated from prompt to prompt) so
that drift in machine speed hits all methods alike. Reported: median tokens/s over prompts, total tokens/s, and
the speedup of each method's total time against plain ``generate``, the paired speedup (the geometric mean over
prompts of each prompt's own speedup: a slow spell of a shared host hits both sides of a pair, where it skews a ratio
of totals) and each prompt's seconds and new tokens; DSpark methods also report τ.

Greedy outputs of every method are compared with plain greedy. In float32/float64 a mismatch is a bug and stops
the run. In bfloat16/float16 a forward over several tokens rounds differently from one over a single token, so a
near-tie in the target's logits can flip under *any* multi-token verifier (transformers' prompt lookup included):
there the count of prompts whose output equals plain greedy is reported per method, and every mismatch must be
explained by a tie (:mod:`hf_dspark.evaluation.ties`, the rule the main command and the demo apply too). A
mismatch that is not a tie stops the run, as in float32, except for a baseline's (``Method.baseline``: another
library's method, transformers' prompt lookup): that one is recorded in the result, with where the outputs part,
and the run goes on — it is not ours to fix, and the measurement of every other method still stands.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..decoding.costs import measure_sps
from ..integration.generate import dspark_generate
from ..plotting import pyplot
from ..settings import resolve_mode
from .evaluate import chat_ids, load_prompts, run_context
from .ties import first_divergence, upcast_copy


@dataclass
class Method:
    """A named way to generate: ``run(input_ids, **generate_kwargs) -> sequences``; ``draft`` for DSpark ones;
    ``baseline`` for another library's method, whose unexplained mismatches are recorded rather than raised."""

    name: str
    run: Callable
    draft: object | None = None
    baseline: bool = False


def standard_methods(
    target, drafts: dict[str, object], gammas: tuple[int, ...] = (4, 8, 16), lookup: int = 0, lookup_min: int = 2
) -> list[Method]:
    """Plain ``generate``, transformers' prompt lookup, and for each named draft: fixed γ (≤ its block size, via
    ``verify_limit``) and ``scheduled`` (when it has a confidence head); with ``lookup`` > 0 also the draft's best
    mode (scheduled, else fixed at its block size) with lookup drafting over n-grams of ``lookup`` down to
    ``lookup_min`` tokens (``{label}-scheduled+lookup``)."""
    methods = [
        Method("plain", lambda ids, **kw: target.generate(ids, **kw)),
        Method(
            "prompt-lookup", lambda ids, **kw: target.generate(ids, prompt_lookup_num_tokens=10, **kw), baseline=True
        ),
    ]

    def dspark(draft, mode, limit, max_ngram=0):
        # the methods share one draft: each call passes every setting it depends on (a chain; None limit: γ)
        settings = {"verify_mode": mode, "verify_limit": limit or draft.config.num_draft_tokens, "tree_top_k": 1,
                    "lookup_max_ngram": max_ngram, "lookup_min_ngram": lookup_min}  # fmt: skip

        def run(ids, **kw):
            return target.generate(ids, custom_generate=dspark_generate, draft=draft, **settings, **kw)

        return run

    for label, draft in drafts.items():
        for g in gammas:
            if g <= draft.config.num_draft_tokens:
                methods.append(Method(f"{label}-fixed{g}", dspark(draft, "fixed", g), draft))
        if draft.confidence is not None:
            methods.append(Method(f"{label}-scheduled", dspark(draft, "scheduled", None), draft))
        if lookup:
            mode = resolve_mode("auto", draft.confidence is not None)
            methods.append(Method(f"{label}-{mode}+lookup", dspark(draft, mode, None, lookup), draft))
    return methods


@torch.no_grad()
def bench(target, tokenizer, methods: list[Method], dataset: str, limit: int | None = None,
          max_new_tokens: int = 128, progress: bool = True) -> dict:  # fmt: skip
    """Run ``methods`` interleaved over the first-turn prompts of ``dataset`` (greedy). Each method's row
    carries ``unexplained``: one ``{"prompt": i, "divergence": text}`` per mismatch no tie explains (only a
    baseline's can be there: anyone else's raises ``RuntimeError``)."""
    from tqdm.auto import tqdm

    prompts = load_prompts(dataset, limit)
    strict = target.dtype in (torch.float32, torch.float64)
    per = {m.name: {"seconds": [], "tokens": [], "committed": 0, "rounds": 0, "looked_up": 0, "same": 0,
                    "unexplained": []} for m in methods}  # fmt: skip
    baselines = {m.name for m in methods if m.baseline}
    exact = None  # a float32 copy of a low-precision target, for the tie check
    for m in methods:  # the scheduler's SPS profile and draft cost, measured (or loaded) before any timing
        if m.draft is not None and m.draft.confidence is not None:
            measure_sps(m.draft, 1)
    for i, text in enumerate(tqdm(prompts, desc=f"bench {dataset}", disable=not progress)):
        ids = chat_ids(tokenizer, text)
        order = methods[i % len(methods) :] + methods[: i % len(methods)]
        outs = {}
        for m in order:
            t0 = time.perf_counter()
            out = m.run(ids, max_new_tokens=max_new_tokens, do_sample=False)
            dt = time.perf_counter() - t0
            outs[m.name] = out
            per[m.name]["seconds"].append(dt)
            per[m.name]["tokens"].append(out.shape[1] - ids.shape[1])
            if m.draft is not None:
                per[m.name]["committed"] += sum(m.draft.stats.committed)
                per[m.name]["rounds"] += m.draft.stats.rounds
                per[m.name]["looked_up"] += sum(m.draft.stats.looked_up)
        reference = outs["plain"].tolist()
        for name, out in outs.items():
            same = out.tolist() == reference
            per[name]["same"] += same
            if same:
                continue
            if not strict and exact is None:
                exact = upcast_copy(target)  # made on the first mismatch only
            found = first_divergence(target, out, outs["plain"], exact, ids.shape[1])
            if not strict and found.tie:
                continue
            if name not in baselines:
                raise RuntimeError(f"{name} produced a different greedy output than plain generate on prompt {i}")
            where = found.describe(tokenizer)
            per[name]["unexplained"].append({"prompt": i, "divergence": where})
            tqdm.write(f"warning: baseline {name} parts from plain greedy on prompt {i}, no tie: {where}")
    plain_time = sum(per["plain"]["seconds"])
    rows = []
    for m in methods:
        p = per[m.name]
        rate = [t / s for t, s in zip(p["tokens"], p["seconds"], strict=True)]
        rows.append({
            "method": m.name,
            "median_tok_per_s": statistics.median(rate),
            "tok_per_s": sum(p["tokens"]) / sum(p["seconds"]),
            "speedup": plain_time / sum(p["seconds"]),
            "paired_speedup": paired_speedup(per["plain"], p),
            "tau": p["committed"] / p["rounds"] if p["rounds"] else None,
            "lookup_rate": p["looked_up"] / p["rounds"] if p["rounds"] else None,  # rounds that verified a lookup
            "same_as_plain": p["same"],
            "unexplained": p["unexplained"],
            "seconds": p["seconds"],
            "tokens": p["tokens"],
        })  # fmt: skip
    return {"dataset": dataset, "prompts": len(prompts), "max_new_tokens": max_new_tokens, "methods": rows,
            **run_context(target)}  # fmt: skip


def warm_up(target, draft, input_ids: torch.Tensor) -> tuple[str, float, float]:
    """Pay the one-time costs before anything is timed: the SPS profile and draft cost the scheduler plans with
    (measured, or loaded from the disk cache) and a first short greedy call of plain and of DSpark ``generate``
    on ``input_ids`` ([1, T]). Returns ("measured" | "loaded", seconds for the profile, seconds for the calls)."""
    from ..decoding.costs import CACHE_DIR

    start, t0 = time.time(), time.perf_counter()
    measure_sps(draft, 1)
    t1 = time.perf_counter()
    target.generate(input_ids, max_new_tokens=8, do_sample=False)
    target.generate(input_ids, assistant_model=draft, max_new_tokens=8, do_sample=False)
    t2 = time.perf_counter()
    how = "measured" if any(p.stat().st_mtime >= start for p in CACHE_DIR.glob("*.json")) else "loaded"
    return how, t1 - t0, t2 - t1


def paired_speedup(plain: dict, method: dict) -> float | None:
    """The geometric mean over prompts of plain's seconds per new token over the method's, from each one's per-prompt
    ``seconds`` and ``tokens`` (prompts where either produced no token are left out; ``None`` if none is left).
    Each prompt's pair ran back to back, so the host's speed at the time cancels in its ratio."""
    logs = [
        math.log((ps / pt) / (ms / mt))
        for ps, pt, ms, mt in zip(plain["seconds"], plain["tokens"], method["seconds"], method["tokens"], strict=True)
        if pt > 0 and mt > 0
    ]
    return math.exp(sum(logs) / len(logs)) if logs else None


def markdown_table(results: list[dict]) -> str:
    """One row per (dataset, method); "= plain" counts prompts whose greedy output equals plain ``generate``'s,
    with a baseline's mismatches that no tie explains in brackets. The paired speedup is shown when every row has
    one (results written before it was recorded have none).
    Results merged from several runs (``readme.merge_bench``) get a "run" column: a speedup is always against
    the plain ``generate`` of its own run."""
    runs = any(m.get("run", 1) > 1 for r in results for m in r["methods"])
    paired = all(m.get("paired_speedup") is not None for r in results for m in r["methods"])
    lines = [
        "| dataset | method | tok/s (median) | speedup vs plain |" + (" paired speedup |" if paired else "")
        + " τ | = plain |" + (" run |" if runs else ""),
        "|---|---|---|---|" + ("---|" if paired else "") + "---|---|" + ("---|" if runs else ""),
    ]  # fmt: skip
    for r in results:
        for m in r["methods"]:
            tau = "-" if m["tau"] is None else f"{m['tau']:.2f}"
            same = f"{m.get('same_as_plain', r['prompts'])}/{r['prompts']}"
            if m.get("unexplained"):
                same += f" ({len(m['unexplained'])} no tie)"
            lines.append(
                f"| {r['dataset']} | {m['method']} | {m['median_tok_per_s']:.1f} | {m['speedup']:.2f}× |"
                + (f" {m['paired_speedup']:.2f}× |" if paired else "")
                + f" {tau} | {same} |"
                + (f" {m.get('run', 1)} |" if runs else "")
            )
    return "\n".join(lines) + "\n"


def plot_speedups(results: list[dict], path) -> None:
    """Grouped bars: speedup per method, one group per dataset (PNG)."""
    plt = pyplot(path)
    if plt is None:
        return None

    names = [m["method"] for m in results[0]["methods"]]
    width = 0.8 / len(names)
    # a colour per method that no other method shares (tab10 repeats after ten), the legend beside the bars
    colours = plt.get_cmap("tab10" if len(names) <= 10 else "tab20").colors
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(results) * len(names) / 3) + 2.5, 4))
    for j, name in enumerate(names):
        xs = [i + j * width for i in range(len(results))]
        ys = [next(m["speedup"] for m in r["methods"] if m["method"] == name) for r in results]
        ax.bar(xs, ys, width, label=name, color=colours[j % len(colours)])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(results))], [r["dataset"] for r in results])
    ax.set_ylabel("speedup vs plain generate")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
