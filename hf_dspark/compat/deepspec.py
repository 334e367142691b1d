"""DeepSpec's released DSpark layout (``deepseek-ai/dspark_qwen3_*_block7``), read and written.

Their checkpoint is a Qwen3-style decoder saved as ``Qwen3DSparkModel``: ``layers.N.self_attn.{q,k,v,o}_proj``,
``q_norm``/``k_norm``, ``layers.N.mlp.*``, ``fc``, ``hidden_norm``, ``norm``, ``markov_head.markov_w1/markov_w2``
(``markov_head.gate_proj`` for the gated head), ``confidence_head.proj``, plus copies of the target's
``embed_tokens`` and ``lm_head``. Its config is the target's Qwen3 config with ``num_hidden_layers`` set to the
draft's depth and ``block_size``, ``mask_token_id``, ``target_layer_ids``, ``num_target_layers``,
``markov_rank``, ``markov_head_type`` (vanilla | gated | rnn: ``markov_head.joint_proj`` is our RNN head's
``rnn_cell``, the same [s; W1[x]; h] -> [gate; candidate; output] map), ``enable_confidence_head`` and
``confidence_head_with_markov`` added. The block convention is DSpark's (anchor + γ-1 masks, γ drafts), the mask
slots use the embedding of ``mask_token_id``, the context reads ``hidden_states[l + 1]``: all as ours.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..configuration_dspark import DSparkConfig

ARCHITECTURE = "Qwen3DSparkModel"
_HEADS_IN = {0: "none", "vanilla": "markov", "gated": "gated", "rnn": "rnn"}
# in order (a later pair sees what earlier ones made); export applies them swapped and in reverse order
_RENAMES = (
    ("markov_head.", "sequential_head."),
    ("sequential_head.joint_proj.", "sequential_head.rnn_cell."),  # the RNN head's joint gate/candidate/output map
    ("confidence_head.proj.", "confidence.confidence_head."),
)
TARGET_COPIES = ("embed_tokens.weight", "lm_head.weight")  # the draft borrows the target's own at use time


def is_deepspec_config(raw: dict) -> bool:
    return ARCHITECTURE in (raw.get("architectures") or []) or (
        raw.get("model_type") != "dspark" and "markov_rank" in raw and "target_layer_ids" in raw
    )


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


def config_from_deepspec(raw: dict) -> DSparkConfig:
    """Translate a DeepSpec DSpark config.json into a :class:`DSparkConfig`."""
    rank = int(raw.get("markov_rank", 0))
    kind = 0 if rank == 0 else str(raw.get("markov_head_type", "vanilla")).lower()
    if kind not in _HEADS_IN:
        raise ValueError(
            f"DeepSpec markov_head_type {kind!r} is not supported by this loader (supported: vanilla, gated, rnn, none)"
        )
    return DSparkConfig(
        block_size=int(raw["block_size"]),
        target_layer_ids=[int(i) for i in raw["target_layer_ids"]],
        **qwen3_backbone(raw),
        mask_token_id=int(raw["mask_token_id"]),
        head_type=_HEADS_IN[kind],
        head_rank=max(rank, 1),
        confidence_head=bool(raw.get("enable_confidence_head", False)),
        confidence_with_head=bool(raw.get("confidence_head_with_markov", False)) and rank > 0,
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


def load_deepspec(model_class, folder: str | Path, raw: dict, dtype: torch.dtype | None = None):
    """Build a ``model_class`` draft from a DeepSpec DSpark checkpoint folder (strict: every tensor must map, shapes
    must match)."""
    folder = Path(folder)
    theirs = {k: v for k, v in read_weights(folder).items() if k not in TARGET_COPIES}
    return load_mapped(model_class, folder, config_from_deepspec(raw), rename_keys(theirs, _RENAMES), "DeepSpec", dtype)


def export_deepspec(draft, folder: str | Path, num_anchors: int = 512, whole_vocab: bool = False) -> Path:
    """Write ``draft`` in DeepSpec's layout (config.json + model.safetensors) so DeepSpec-compatible engines load it.

    Needs a Qwen3-style draft (per-head q/k norms), a ``mask_token_id`` (DeepSpec embeds mask slots with a token of
    the vocabulary) and an attached target (its embedding and LM head are part of DeepSpec's checkpoint).
    DeepSpec's layout has no draft vocabulary: a draft with one is refused unless ``whole_vocab``, which writes it
    proposing over the whole vocabulary (the sequential head's rows for the other tokens are zero). Its output
    stays the target's; its acceptance may differ slightly from the draft-vocabulary draft's.
    """
    c = draft.config
    if not c.qk_norm:
        raise ValueError("DeepSpec's layout is Qwen3-style: it needs per-head q/k norms (qk_norm=True)")
    if c.mask_token_id is None:
        raise ValueError("DeepSpec embeds mask slots with a vocabulary token: this draft uses a learned mask vector")
    if any(c.sliding_layers):
        raise ValueError("DeepSpec's layout has no sliding-window layers: this draft has sliding_attention layers")
    if c.draft_offset != 0:
        raise ValueError(
            "DeepSpec's layout drafts from every slot, the anchor's included (draft_offset=0); this draft uses "
            "DFlash's convention (draft_offset=1): export it with export_speculators, which records the convention"
        )
    if c.draft_vocab_size is not None and not whole_vocab:
        raise ValueError(
            f"DeepSpec's layout has no draft vocabulary (this draft proposes {c.draft_vocab_size} tokens): pass "
            "whole_vocab=True to export it proposing over the whole vocabulary, or export it with "
            "export_speculators, whose layout keeps the draft vocabulary"
        )
    if not draft.is_attached:
        raise ValueError("attach the draft to its target first: DeepSpec checkpoints carry embed_tokens and lm_head")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ours_to_theirs = [(new, old) for old, new in reversed(_RENAMES)]
    state = {k: v for k, v in draft.state_dict().items() if k != "draft_vocab"}
    if draft.sequential_head is not None:  # a head storing draft-vocabulary rows writes them over the whole vocabulary
        state["sequential_head.markov_w2.weight"] = draft._full_head_weight()
    weights = {k: v.detach().contiguous().cpu() for k, v in rename_keys(state, ours_to_theirs).items()}
    weights["embed_tokens.weight"] = draft._target.embed_tokens.weight.detach().cpu().contiguous()
    # a copy: targets that tie their LM head to the embedding (SmolLM2) would otherwise hand safetensors one tensor
    # under two names, which it refuses to write
    weights["lm_head.weight"] = draft._target.lm_head.weight.detach().cpu().contiguous().clone()
    kind = {"none": None, "markov": "vanilla", "gated": "gated", "rnn": "rnn"}[c.head_type]
    raw = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "max_position_embeddings": c.max_position_embeddings,
        "attention_bias": c.attention_bias,
        "vocab_size": c.target_vocab_size,
        "num_hidden_layers": c.num_draft_layers,
        "num_target_layers": c.target_num_layers,
        "layer_types": ["full_attention"] * c.num_draft_layers,
        "tie_word_embeddings": False,
        "block_size": c.block_size,
        "mask_token_id": c.mask_token_id,
        "target_layer_ids": list(c.target_layer_ids),
        "num_anchors": num_anchors,
        "markov_rank": 0 if kind is None else c.head_rank,
        "enable_confidence_head": bool(c.confidence_head),
        "torch_dtype": str(draft.dtype).replace("torch.", ""),
    }
    if kind is not None:
        raw["markov_head_type"] = kind
    if c.confidence_head:
        raw["confidence_head_with_markov"] = bool(c.confidence_with_head and kind is not None)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    return folder
