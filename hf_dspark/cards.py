"""Model cards for drafts: ``model_cards/dspark_draft.md`` rendered from a draft's config and its result files.

The template travels inside the package (installed as ``hf_dspark.model_cards``), so cards render from a wheel as
from a checkout.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from string import Template

TEMPLATE = resources.files("hf_dspark.model_cards") / "dspark_draft.md"


def _template() -> str:
    return TEMPLATE.read_text(encoding="utf-8")


def _table(results: list[dict] | None, kind: str) -> str:
    if not results:
        return "Not measured yet."
    from .evaluation import bench, evaluate

    first = results[0]
    where = (
        f"Measured {first.get('date', '?')} on {first.get('machine', '?')}, {first.get('threads', '?')} threads, "
        f"{first.get('device', '?')}, {first.get('dtype', '?')}.\n\n"
    )
    return where + (evaluate.markdown_table if kind == "eval" else bench.markdown_table)(results)


def render_card(draft_dir: str | Path, name: str | None = None, target: str | None = None,
                license: str = "mit") -> str:  # fmt: skip
    """Render the card for the draft in ``draft_dir``. Reads the draft (its config and decoding settings) and, when
    present, ``eval.json``, ``bench.json`` and ``training.json`` (``{"command", "data", "steps", "target weights",
    ...}``) from the same folder."""
    from .model.modeling_dspark import DSparkDraftModel

    folder = Path(draft_dir)
    draft = DSparkDraftModel.from_pretrained(folder)
    load = lambda f: json.loads((folder / f).read_text()) if (folder / f).is_file() else None  # noqa: E731
    training = load("training.json")
    if training:
        # structured entries (e.g. ``runs``, for tools continuing the training) stay out of the prose
        training_text = "\n".join(f"- **{k}**: {v}" for k, v in training.items() if not isinstance(v, list | dict))
    else:
        training_text = "No training record in this folder."
    weights = (training or {}).get("target weights")
    weights_text = (
        f"Trained and measured against these weights of the target: {weights}. Its acceptance with other weights of"
        " the same model (e.g. the original checkpoint the snippet above loads) is not measured; the output stays"
        " the target's either way, only the speed may differ."
        if weights
        else "The training record does not say which weights of the target the draft was trained against."
    )
    c, d = draft.config, draft.decoding
    report = load("calibration.json") or {}
    by = {"ece": ", each minimising ECE", "brier": ", each minimising the Brier score"}.get(report.get("objective"), "")
    fitted_on = {
        "decode": f" (fitted on {report.get('blocks')} blocks of greedy DSpark decoding in {report.get('dtype')}{by})",
        "teacher-forced": f" (fitted on {report.get('blocks')} teacher-forced held-out blocks{by})",
    }.get(report.get("source"), "")
    return Template(_template()).substitute(
        name=name or folder.name,
        target=target or c.target_model_type or "unknown",
        target_type=c.target_model_type,
        target_layers=c.target_num_layers,
        target_hidden=c.target_hidden_size,
        vocab=c.target_vocab_size,
        block_size=c.block_size,
        draft_layers=c.num_draft_layers,
        target_layer_ids=c.target_layer_ids,
        head=c.head_type,
        rank=c.head_rank,
        confidence="a confidence head" if c.confidence_head else "no confidence head",
        confidence_row="c_k = σ(wᵀ[h_k; W1[x_{k-1}]]); the prefix scheduler picks verify lengths from it"
        if c.confidence_head
        else "none (every block is verified at a fixed length)",
        calibration="per-position temperatures " + str([round(t, 3) for t in c.sts_temperatures]) + fitted_on
        if c.sts_temperatures
        else "not calibrated",
        mask="learned mask embedding" if c.mask_token_id is None else f"token id {c.mask_token_id}",
        draft_vocab="the whole vocabulary"
        if c.draft_vocab_size is None
        else f"{c.draft_vocab_size} tokens (proposals restricted to them; verification uses the full vocabulary)",
        lookup=f"on: n-grams of {d.lookup_max_ngram} down to {d.lookup_min_ngram} tokens that occurred earlier are "
        f"continued from the text (up to {d.lookup_max_tokens or c.num_draft_tokens} tokens"
        f"{', growing from a block with each lookup accepted in full' if d.lookup_adaptive else ''}), the draft "
        "proposes elsewhere (`decoding.lookup_max_ngram = 0` turns it off)"
        if d.lookup_max_ngram
        else "off (`decoding.lookup_max_ngram = 3` turns it on)",
        params=f"{sum(p.numel() for p in draft.parameters()) / 1e6:.2f} M",
        training=training_text,
        target_weights=weights_text,
        eval=_table(load("eval.json"), "eval"),
        bench=_table(load("bench.json"), "bench"),
        license=license,
    )


def write_card(draft_dir: str | Path, **kwargs) -> Path:
    """Write ``README.md`` (the rendered card) into ``draft_dir``."""
    path = Path(draft_dir) / "README.md"
    path.write_text(render_card(draft_dir, **kwargs))
    return path
