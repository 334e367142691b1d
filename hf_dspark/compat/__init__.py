"""Checkpoint layouts of other DSpark implementations: import (through ``from_pretrained``) and export."""

from .deepspec import export_deepspec, is_deepspec_config, load_deepspec
from .dflash import is_dflash_config, load_dflash
from .muse_glimmer import is_muse_glimmer_config, load_muse_glimmer
from .speculators import export_speculators, is_speculators_config, load_speculators

__all__ = [
    "export_deepspec",
    "export_speculators",
    "is_deepspec_config",
    "is_dflash_config",
    "is_muse_glimmer_config",
    "is_speculators_config",
    "load_deepspec",
    "load_dflash",
    "load_muse_glimmer",
    "load_speculators",
]
