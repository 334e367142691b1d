"""transformers' native DFlash drafters (``MuseGlimmerAssistantModel``, transformers >= 5.25), read through
``from_pretrained``.

Such a checkpoint is what ``MuseGlimmerAssistantModel.save_pretrained`` writes: ``encoder.fc`` and
``encoder.output_norm_enc`` (our ``fc`` and ``hidden_norm``: the fused target layers and their RMSNorm),
``layers.N.*`` (pre-norm Qwen3-style layers with per-head q/k norms, the names already ours) and ``norm``, with no
embedding or LM head (the target's are used). transformers drives it with ``DFlashTokenCandidateGenerator``: the
block is the anchor and ``block_size - 1`` mask tokens, and the LM head reads the mask slots only, which is our
``draft_offset=1``. Its layers default to ``sliding_attention``: a slot at position p sees keys at positions q with
|p - q| <= ``sliding_window``, which our ``layer_types``/``sliding_window`` reproduce.

Variants this loader cannot reproduce are refused by name: a RoPE other than the default one, an activation other
than SiLU.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..model.configuration_dspark import DSparkConfig
from .common import load_mapped, read_weights, rename_keys
from .registry import CheckpointFormat, register

MODEL_TYPE = "muse_glimmer_assistant"
ARCHITECTURE = "MuseGlimmerAssistantModel"
DEFAULT_ROPE_THETA = 500_000.0  # MuseGlimmerAssistantConfig.default_theta, used when rope_parameters is absent
_RENAMES = [("encoder.fc.", "fc."), ("encoder.output_norm_enc.", "hidden_norm.")]


def is_muse_glimmer_config(raw: dict) -> bool:
    return raw.get("model_type") == MODEL_TYPE or ARCHITECTURE in (raw.get("architectures") or [])


def config_from_muse_glimmer(raw: dict, target_vocab_size: int | None) -> DSparkConfig:
    """Translate a ``MuseGlimmerAssistantConfig`` config.json into a :class:`DSparkConfig` (DFlash convention, no
    sequential or confidence head) for a target of ``target_vocab_size`` tokens, which the config does not record.
    Missing fields take that class's defaults."""
    if target_vocab_size is None:
        raise ValueError(
            f"a {ARCHITECTURE} checkpoint does not record its target's vocabulary: pass target_vocab_size="
            "target.config.get_text_config().vocab_size to from_pretrained"
        )
    rope = raw.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{ARCHITECTURE} with rope_type {rope['rope_type']!r}: only the default RoPE is supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{ARCHITECTURE} with hidden_act {raw['hidden_act']!r}: only silu is supported")
    layers = int(raw.get("num_hidden_layers", 5))
    hidden = raw.get("hidden_size", 6656)
    heads = raw.get("num_attention_heads", 32)
    return DSparkConfig(
        block_size=int(raw.get("block_size", 16)),
        draft_offset=1,
        target_layer_ids=[int(i) for i in raw.get("target_layer_ids") or [1, 13, 25, 37, 49]],
        num_draft_layers=layers,
        hidden_size=hidden,
        intermediate_size=raw.get("intermediate_size", 19968),
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads", 8),
        head_dim=raw.get("head_dim", hidden // heads),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
        rope_theta=rope.get("rope_theta", DEFAULT_ROPE_THETA),
        max_position_embeddings=raw.get("max_position_embeddings", 131072),
        layer_types=raw.get("layer_types") or ["sliding_attention"] * layers,
        sliding_window=raw.get("sliding_window", 2048),
        qk_norm=True,
        mask_token_id=int(raw.get("mask_token_id", 201818)),
        head_type="none",
        confidence_head=False,
        target_hidden_size=hidden,  # the context projection reads len(target_layer_ids) · hidden_size features
        target_vocab_size=int(target_vocab_size),
    )


def load_muse_glimmer(model_class, folder: str | Path, raw: dict, dtype: torch.dtype | None = None,
                      target_vocab_size: int | None = None):  # fmt: skip
    """Build a ``model_class`` draft from a ``MuseGlimmerAssistantModel`` checkpoint folder for a target of
    ``target_vocab_size`` tokens (strict: every tensor must map, shapes must match)."""
    folder = Path(folder)
    config = config_from_muse_glimmer(raw, target_vocab_size)
    theirs = {k.removeprefix("model."): v for k, v in read_weights(folder).items()}
    return load_mapped(model_class, folder, config, rename_keys(theirs, _RENAMES), ARCHITECTURE, dtype)


FORMAT = register(
    CheckpointFormat("muse_glimmer", 50, "transformers' MuseGlimmerAssistantModel", is_muse_glimmer_config,
                     load_muse_glimmer)
)  # fmt: skip
