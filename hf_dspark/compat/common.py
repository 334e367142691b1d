"""What every checkpoint layout's loader shares: reading safetensors, renaming keys, a strict load, and the
Qwen3-style backbone fields that DeepSpec's and z-lab's configs both describe."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..model.configuration_dspark import DSparkConfig

TARGET_COPIES = ("embed_tokens.weight", "lm_head.weight")  # the draft borrows the target's own at use time


def qwen3_backbone(raw: dict) -> dict:
    """DSparkConfig fields of a Qwen3-style draft decoder and its target's identity, from a foreign config.json.

    Both DeepSpec and z-lab save the draft with the target's Qwen3 config (their drafts share its width and
    vocabulary), so ``hidden_size``/``vocab_size`` also identify the target."""
    rope = raw.get("rope_parameters") or {}
    return dict(
        num_draft_layers=int(raw["num_hidden_layers"]),
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
        target_model_type=raw.get("model_type", "qwen3"),
        target_hidden_size=raw["hidden_size"],
        target_vocab_size=raw["vocab_size"],
        target_num_layers=raw.get("num_target_layers"),
    )


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        weights = {}
        for f in files:
            weights.update(load_file(folder / f))
        return weights
    single = folder / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")
    return load_file(single)


def check_mapping(model, mapped: dict, folder: Path, layout: str) -> None:
    """``ValueError`` naming every tensor of ``mapped`` (a foreign checkpoint renamed to our keys) that is missing
    from, unexpected in, or shaped differently from ``model``'s state dict."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(mapped))
    unexpected = sorted(set(mapped) - set(expected))
    shapes = [f"{k} {tuple(mapped[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items()
              if k in mapped and mapped[k].shape != v.shape]  # fmt: skip
    if missing or unexpected or shapes:
        raise ValueError(
            f"{layout} checkpoint {folder} does not map onto a DSpark draft: missing {missing}, "
            f"unexpected {unexpected}, mis-shaped {shapes}"
        )


def rename_keys(state: dict, renames) -> dict:
    """``state`` with each key's prefix ``old`` replaced by ``new`` for the ``(old, new)`` pairs, in order (a later
    pair sees what earlier ones made). Swap the pairs to go the other way."""
    renamed = {}
    for key, value in state.items():
        for old, new in renames:
            if key.startswith(old):
                key = new + key[len(old) :]
        renamed[key] = value
    return renamed


def load_mapped(model_class, folder: Path, config: DSparkConfig, mapped: dict, layout: str, dtype=None):
    """Build a ``model_class`` draft (the draft class, handed in by the caller) from ``mapped``, a foreign checkpoint
    already renamed to our keys, strictly (:func:`check_mapping`). Without ``dtype`` it is built in the checkpoint's
    own precision, so loading rounds nothing."""
    if dtype is None:
        dtype = next((v.dtype for k, v in mapped.items() if v.is_floating_point() and "norm" not in k), None)
    model = model_class(config)
    model = model.to(dtype) if dtype is not None else model
    check_mapping(model, mapped, folder, layout)
    model.load_state_dict(mapped)
    model.config.name_or_path = str(folder)
    return model
