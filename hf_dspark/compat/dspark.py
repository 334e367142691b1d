"""Our own layout: ``config.json`` with ``model_type`` "dspark", ``decoding_config.json`` and ``model.safetensors``,
read by ``PreTrainedModel.from_pretrained`` itself (so its registry entry has no loader)."""

from __future__ import annotations

from pathlib import Path

from .registry import CheckpointFormat, register


def is_dspark_config(raw: dict) -> bool:
    return raw.get("model_type") == "dspark"


def export_dspark(draft, folder: str | Path, verifier: str | None = None) -> Path:
    """``draft.save_pretrained(folder)`` (``verifier`` is not recorded: the config names its target by shape)."""
    draft.save_pretrained(folder)
    return Path(folder)


FORMAT = register(
    CheckpointFormat("dspark", 10, "a DSpark draft (model_type 'dspark')", is_dspark_config, None, export_dspark)
)
