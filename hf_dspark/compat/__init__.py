"""Checkpoint layouts of other DSpark implementations: import (through ``from_pretrained``) and export."""

from .deepspec import export_deepspec, is_deepspec_config, load_deepspec

__all__ = ["export_deepspec", "is_deepspec_config", "load_deepspec"]
