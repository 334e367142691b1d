"""Checkpoint formats: our own and other implementations' layouts, each one registry entry (detect, load,
export; :mod:`hf_dspark.compat.registry`) in its own module over :mod:`hf_dspark.compat.common`.

The imports below register the formats; each names its own priority (the order ``from_pretrained`` asks them),
and :func:`~hf_dspark.compat.registry.read_layout` is the front door that asks them.
"""

from . import deepspec, dflash, dspark, muse_glimmer, speculators  # noqa: F401  (each registers itself)
from .deepspec import export_deepspec
from .registry import FORMATS, CheckpointFormat, ExportNote, detect, exportable, read_layout, register
from .speculators import export_speculators

__all__ = [
    "FORMATS",
    "CheckpointFormat",
    "ExportNote",
    "detect",
    "export_deepspec",
    "export_speculators",
    "exportable",
    "read_layout",
    "register",
]
