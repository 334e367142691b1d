"""The registry of checkpoint formats: each one a name, a priority, a detector, a loader and (where we write it)
an exporter.

:func:`read_layout` is the one front door: ``DSparkDraftModel.from_pretrained`` reaches it (``hf_dspark/__init__``
installs it on the model class), and it asks :func:`detect` which format a ``config.json`` is in, formats in order
of their ``priority`` (a narrower detector asks first); its error text lists :func:`described`, and
``hf-dspark export --format`` offers :func:`exportable`. A format registers itself in its own module
(``FORMAT = register(CheckpointFormat(...))``) over the helpers in :mod:`hf_dspark.compat.common`;
``hf_dspark/compat/__init__.py`` imports the modules, so adding a format touches that list and one new file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..model.checkpoint_files import check_weight_files, read_config
from ..model.modeling_dspark import check_vocab


class ExportNote(UserWarning):
    """Something an export did that its user should know (e.g. a draft vocabulary widened), not a fault."""


@dataclass(frozen=True)
class CheckpointFormat:
    """One checkpoint layout.

    name: what ``--format`` and error texts call it. priority: formats are asked in increasing priority (a
    narrower detector gets a lower number than a broader one that would also accept its configs).
    description: the layout in a few words, for error texts.
    detect(raw config.json dict) -> whether a checkpoint is in this layout.
    load(model_class, folder, raw, dtype=None, target_vocab_size=None) -> the draft, strictly mapped (every tensor
    must land, shapes must match); ``None``: our own layout, which ``PreTrainedModel.from_pretrained`` reads.
    export(draft, folder, verifier=None) -> the folder written (``verifier``: the target's Hub id, for formats that
    record it); ``None``: not written by this package. It warns (``ExportNote`` for what it changed, other warnings
    for what the user may need to fix) rather than prints.
    """

    name: str
    priority: int
    description: str
    detect: Callable[[dict], bool]
    load: Callable | None = None
    export: Callable[..., Path] | None = None


FORMATS: dict[str, CheckpointFormat] = {}


def register(fmt: CheckpointFormat) -> CheckpointFormat:
    """Add ``fmt`` to the registry (``ValueError`` if its name is taken) and return it."""
    if fmt.name in FORMATS:
        raise ValueError(f"a checkpoint format named {fmt.name!r} is already registered")
    FORMATS[fmt.name] = fmt
    ordered = sorted(FORMATS.values(), key=lambda f: (f.priority, f.name))
    FORMATS.clear()
    FORMATS.update((f.name, f) for f in ordered)  # kept in priority order: every reader sees that order
    return fmt


def detect(raw: dict) -> CheckpointFormat | None:
    """The format of lowest priority whose detector accepts ``raw`` (a ``config.json`` dict), or ``None``."""
    return next((fmt for fmt in FORMATS.values() if fmt.detect(raw)), None)


def described() -> str:
    """Every registered format in words, for error texts: "a (name), b (name) or c (name)"."""
    items = [f"{fmt.description} ({fmt.name})" for fmt in FORMATS.values()]
    return ", ".join(items[:-1]) + " or " + items[-1] if len(items) > 1 else "".join(items)


def exportable() -> list[str]:
    """Names of the formats this package writes, in priority order."""
    return [name for name, fmt in FORMATS.items() if fmt.export is not None]


def unknown_layout(name_or_path, raw: dict) -> ValueError:
    """The error for a ``config.json`` that no registered format recognises."""
    return ValueError(
        f"{name_or_path}: unknown checkpoint layout (model_type={raw.get('model_type')!r}, "
        f"architectures={raw.get('architectures')}); expected {described()}"
    )


def read_layout(model_class, name_or_path, folder: Path, kwargs: dict):
    """The front door for every layout: a draft loaded from a checkpoint ``folder`` written by another
    implementation (DeepSpec, z-lab DFlash, speculators, transformers' native DFlash drafters), or ``None`` for our
    own layout, which ``PreTrainedModel.from_pretrained`` reads. ``kwargs``: ``from_pretrained``'s (``dtype``,
    ``target_vocab_size``, which transformers' native drafters do not record and the caller then must give).

    Raises ``FileNotFoundError`` naming the path or file for a missing folder, config.json or weights file, and
    ``ValueError`` naming the file for a damaged one or a config.json that is neither ours nor a layout we know."""
    raw = read_config(folder)
    fmt = detect(raw)
    if fmt is None:
        raise unknown_layout(name_or_path, raw)
    check_weight_files(folder)
    if fmt.load is None:
        return None
    vocab = kwargs.get("target_vocab_size")
    model = fmt.load(model_class, folder, raw, dtype=kwargs.get("dtype"), target_vocab_size=vocab)
    check_vocab(name_or_path, model, vocab)
    return model
