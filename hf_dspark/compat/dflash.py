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

from ..configuration_dspark import DSparkConfig
from .deepspec import load_mapped, read_weights

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
    rope = raw.get("rope_parameters") or {}
    return DSparkConfig(
        block_size=int(block),
        draft_offset=1,
        num_draft_layers=int(raw["num_hidden_layers"]),
        target_layer_ids=[int(i) for i in layer_ids],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]),
        head_dim=raw.get("head_dim"),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", raw.get("rope_theta", 1_000_000.0)),
        max_position_embeddings=raw.get("max_position_embeddings", 40960),
        qk_norm=True,
        attention_bias=raw.get("attention_bias", False),
        mask_token_id=int(mask),
        head_type="none",
        confidence_head=False,
        target_model_type=raw.get("model_type", "qwen3"),
        target_hidden_size=raw["hidden_size"],
        target_vocab_size=raw["vocab_size"],
        target_num_layers=raw.get("num_target_layers"),
    )


def load_dflash(folder: str | Path, raw: dict, dtype: torch.dtype | None = None):
    """Build our draft from a z-lab DFlash checkpoint folder (strict mapping: names are already ours)."""
    folder = Path(folder)
    return load_mapped(folder, config_from_dflash(raw), read_weights(folder), renames=(), layout="DFlash", dtype=dtype)
