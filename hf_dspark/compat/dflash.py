"""z-lab's DFlash layout (``z-lab/Qwen3-*-DFlash-*``), read through ``from_pretrained``.

A ``DFlashDraftModel`` checkpoint is a Qwen3-style decoder without embedding or LM head: ``layers.N.self_attn.*``
(with ``q_norm``/``k_norm``), ``layers.N.mlp.*``, the two layer norms, ``fc``, ``hidden_norm``, ``norm``. Its
config is a Qwen3 config with ``num_target_layers`` and ``dflash_config`` (``target_layer_ids``,
``mask_token_id``, ``block_size``; older configs keep ``block_size`` at the top level). Convention: the block is
the anchor plus B-1 mask tokens and only the mask slots propose (slot k proposes the token at its own position),
which our model expresses as ``draft_offset=1``: B slots, B-1 drafts. No sequential or confidence head.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..model.configuration_dspark import DSparkConfig
from .common import TARGET_COPIES, load_mapped, qwen3_backbone, read_weights
from .registry import CheckpointFormat, register

ARCHITECTURE = "DFlashDraftModel"


def is_dflash_config(raw: dict) -> bool:
    return "dflash_config" in raw or ARCHITECTURE in (raw.get("architectures") or [])


def config_from_dflash(raw: dict) -> DSparkConfig:
    """Translate a z-lab DFlash config.json into a :class:`DSparkConfig` (DFlash block convention)."""
    dflash = raw.get("dflash_config") or {}
    layer_ids = dflash.get("target_layer_ids")
    if layer_ids is None:
        raise ValueError(
            "DFlash config has no dflash_config.target_layer_ids: cannot tell which target layers it reads"
        )
    mask = dflash.get("mask_token_id", raw.get("mask_token_id"))
    block = dflash.get("block_size", raw.get("block_size"))
    if mask is None or block is None:
        raise ValueError("DFlash config needs mask_token_id and block_size (in dflash_config or at the top level)")
    if "sliding_attention" in (raw.get("layer_types") or []):
        raise ValueError("DFlash drafts with sliding-window layers are not supported by this loader")
    return DSparkConfig(
        block_size=int(block),
        draft_offset=1,
        target_layer_ids=[int(i) for i in layer_ids],
        **qwen3_backbone(raw),
        mask_token_id=int(mask),
        head_type="none",
        confidence_head=False,
    )


def load_dflash(model_class, folder: str | Path, raw: dict, dtype: torch.dtype | None = None, target_vocab_size=None):
    """Build a ``model_class`` draft from a z-lab DFlash checkpoint folder (strict mapping: names are already ours)."""
    folder = Path(folder)
    config = config_from_dflash(raw)
    mapped = {k: v for k, v in read_weights(folder).items() if k not in TARGET_COPIES}  # names are already ours
    return load_mapped(model_class, folder, config, mapped, "DFlash", dtype)


FORMAT = register(CheckpointFormat("dflash", 40, "z-lab's DFlashDraftModel layout", is_dflash_config, load_dflash))
