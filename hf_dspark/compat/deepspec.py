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
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..model.configuration_dspark import DSparkConfig
from .common import TARGET_COPIES, load_mapped, qwen3_backbone, read_weights, rename_keys
from .registry import CheckpointFormat, ExportNote, register

ARCHITECTURE = "Qwen3DSparkModel"
_HEADS_IN = {0: "none", "vanilla": "markov", "gated": "gated", "rnn": "rnn"}
# in order (a later pair sees what earlier ones made); export applies them swapped and in reverse order
_RENAMES = (
    ("markov_head.", "sequential_head."),
    ("sequential_head.joint_proj.", "sequential_head.rnn_cell."),  # the RNN head's joint gate/candidate/output map
    ("confidence_head.proj.", "confidence.confidence_head."),
)


def is_deepspec_config(raw: dict) -> bool:
    return ARCHITECTURE in (raw.get("architectures") or []) or (
        raw.get("model_type") != "dspark" and "markov_rank" in raw and "target_layer_ids" in raw
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


def load_deepspec(model_class, folder: str | Path, raw: dict, dtype: torch.dtype | None = None, target_vocab_size=None):
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
    weights["embed_tokens.weight"] = draft.borrowed.embed_tokens.weight.detach().cpu().contiguous()
    # a copy: targets that tie their LM head to the embedding (SmolLM2) would otherwise hand safetensors one tensor
    # under two names, which it refuses to write
    weights["lm_head.weight"] = draft.borrowed.lm_head.weight.detach().cpu().contiguous().clone()
    heads_out = {"none": None, "markov": "vanilla", "gated": "gated", "rnn": "rnn"}
    if c.head_type not in heads_out:
        raise ValueError(f"DeepSpec's layout has no sequential head {c.head_type!r} (it has {sorted(heads_out)})")
    kind = heads_out[c.head_type]
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


def export_whole_vocab(draft, folder: str | Path, verifier: str | None = None) -> Path:
    """The registry's exporter: :func:`export_deepspec` with a draft vocabulary widened to the whole one (said in
    an :class:`ExportNote`, not refused); ``verifier`` is not recorded (the layout has no field for it)."""
    if draft.config.draft_vocab_size is not None:
        warnings.warn(
            "DeepSpec's layout has no draft vocabulary, so the export proposes over the whole vocabulary "
            f"(this draft proposes {draft.config.draft_vocab_size} tokens; the output stays the target's, "
            "acceptance may differ slightly). --format speculators keeps the draft vocabulary.",
            ExportNote,
            stacklevel=2,
        )
    return export_deepspec(draft, folder, whole_vocab=True)


FORMAT = register(
    CheckpointFormat("deepspec", 30, "DeepSpec's Qwen3DSparkModel layout (sglang's too)", is_deepspec_config,
                     load_deepspec, export_whole_vocab)
)  # fmt: skip
