"""The registry of checkpoint formats: each one a name, a detector, a loader and (where we write it) an exporter.

``DSparkDraftModel.from_pretrained`` asks :func:`detect` which format a ``config.json`` is in, its error text lists
:func:`described`, and ``hf-dspark export --format`` offers :func:`exportable`. A format registers itself in its
own module (``FORMAT = register(CheckpointFormat(...))``) over the helpers in :mod:`hf_dspark.compat.common`;
``hf_dspark/compat/__init__.py`` imports the modules, so adding a format touches that list and one new file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class ExportNote(UserWarning):
    """Something an export did that its user should know (e.g. a draft vocabulary widened), not a fault."""


@dataclass(frozen=True)
class CheckpointFormat:
    """One checkpoint layout.

    name: what ``--format`` and error texts call it. description: the layout in a few words, for error texts.
    detect(raw config.json dict) -> whether a checkpoint is in this layout (formats are asked in registration
    order, so a narrower one registers first).
    load(model_class, folder, raw, dtype=None, target_vocab_size=None) -> the draft, strictly mapped (every tensor
    must land, shapes must match); ``None``: our own layout, which ``PreTrainedModel.from_pretrained`` reads.
    export(draft, folder, verifier=None) -> the folder written (``verifier``: the target's Hub id, for formats that
    record it); ``None``: not written by this package. It warns (``ExportNote`` for what it changed, other warnings
    for what the user may need to fix) rather than prints.
    """

    name: str
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
    return fmt


def detect(raw: dict) -> CheckpointFormat | None:
    """The first registered format whose detector accepts ``raw`` (a ``config.json`` dict), or ``None``."""
    return next((fmt for fmt in FORMATS.values() if fmt.detect(raw)), None)


def described() -> str:
    """Every registered format in words, for error texts: "a (name), b (name) or c (name)"."""
    items = [f"{fmt.description} ({fmt.name})" for fmt in FORMATS.values()]
    return ", ".join(items[:-1]) + " or " + items[-1] if len(items) > 1 else "".join(items)


def exportable() -> list[str]:
    """Names of the formats this package writes, in registration order."""
    return [name for name, fmt in FORMATS.items() if fmt.export is not None]


def unknown_layout(name_or_path, raw: dict) -> ValueError:
    """The error for a ``config.json`` that no registered format recognises."""
    return ValueError(
        f"{name_or_path}: unknown checkpoint layout (model_type={raw.get('model_type')!r}, "
        f"architectures={raw.get('architectures')}); expected {described()}"
    )
