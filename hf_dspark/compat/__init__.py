"""Checkpoint formats: our own and other implementations' layouts, each one registry entry (detect, load,
export; :mod:`hf_dspark.compat.registry`) in its own module over :mod:`hf_dspark.compat.common`.

The imports below register the formats, in the order ``from_pretrained`` asks them (narrower detectors first).
"""

from . import dspark, speculators, deepspec, dflash, muse_glimmer  # noqa: F401, I001  (order = detection order)
from .deepspec import export_deepspec
from .registry import FORMATS, CheckpointFormat, ExportNote, detect, exportable, register
from .speculators import export_speculators

__all__ = [
    "FORMATS",
    "CheckpointFormat",
    "ExportNote",
    "detect",
    "export_deepspec",
    "export_speculators",
    "exportable",
    "register",
]
