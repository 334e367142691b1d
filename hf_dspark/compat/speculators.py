"""The ``speculators`` layout (vLLM's format for speculative-decoding drafts): DSpark and DFlash drafts, both ways.

A ``speculators`` checkpoint is a ``config.json`` with ``speculators_model_type`` ("dspark" or "dflash"), the draft
decoder's ``transformer_layer_config`` (the verifier's config with the draft's layer count), the draft fields
(``block_size``, ``aux_hidden_state_layer_ids``, ``mask_token_id``, ``sample_from_anchor``, ``draft_vocab_size``,
``markov_rank``, ``markov_head_type``, ``enable_confidence_head``, ``confidence_head_with_markov``) and a
``speculators_config`` naming the verifier; plus ``model.safetensors``. Its decoder layers are always Qwen3-style
(per-head q/k RMSNorm), its mask slots embed ``mask_token_id``, its draft vocabulary is a boolean ``t2d`` over the
verifier's vocabulary with ``d2t`` offsets (draft id + d2t = verifier id), and with a draft vocabulary it stores
the reduced ``lm_head`` and a ``markov_w2`` over the draft vocabulary only. Our names map one to one otherwise
(``markov_head.*`` ↔ ``sequential_head.*``, ``joint_proj`` ↔ ``rnn_cell``, ``confidence_head.proj`` ↔
``confidence.confidence_head``).

What the format cannot hold is refused with the remedy: a learned mask vector (it needs ``mask_token_id``), a
Llama-style draft without q/k norms (``qk_norm=True``), a draft narrower than its target. STS temperatures have no
field there: they are written beside the config (``hf_dspark.json``) and read back from it.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..model.checkpoint_files import looks_like_path
from ..model.configuration_dspark import DSparkConfig
from ..settings import DecodingConfig
from .common import TARGET_COPIES, load_mapped, read_weights, rename_keys
from .registry import CheckpointFormat, register

# their names -> ours (swapped for export); the RNN cell's pair first, before "markov_head." takes the rest
_RENAMES = (
    ("markov_head.joint_proj.", "sequential_head.rnn_cell."),
    ("markov_head.", "sequential_head."),
    ("confidence_head.proj.", "confidence.confidence_head."),
)
_RENAMES_OUT = tuple((ours, theirs) for theirs, ours in _RENAMES)
_HEADS_IN = {"vanilla": "markov", "gated": "gated", "rnn": "rnn"}
_HEADS_OUT = {v: k for k, v in _HEADS_IN.items()}
EXTRAS = "hf_dspark.json"  # what the format has no field for: STS temperatures, verify settings


def is_speculators_config(raw: dict) -> bool:
    return raw.get("speculators_model_type") in ("dspark", "dflash")


def config_from_speculators(raw: dict) -> DSparkConfig:
    """Translate a ``speculators`` DSpark/DFlash config.json into a :class:`DSparkConfig`."""
    kind = raw["speculators_model_type"]
    layer = dict(raw["transformer_layer_config"])
    if "sliding_attention" in (layer.get("layer_types") or []):
        raise ValueError("speculators drafts with sliding-window layers are not supported by this loader")
    if raw.get("mask_token_id") is None or raw.get("aux_hidden_state_layer_ids") is None:
        raise ValueError("a speculators draft needs mask_token_id and aux_hidden_state_layer_ids in its config")
    rank = int(raw.get("markov_rank", 256)) if kind == "dspark" else 0
    head = "none" if rank == 0 else _HEADS_IN.get(raw.get("markov_head_type", "vanilla"))
    if head is None:
        raise ValueError(f"unknown markov_head_type {raw.get('markov_head_type')!r} (vanilla, gated or rnn)")
    confidence = kind == "dspark" and bool(raw.get("enable_confidence_head", True))
    rope = layer.get("rope_parameters") or {}
    vocab, draft_vocab = int(layer["vocab_size"]), int(raw.get("draft_vocab_size") or layer["vocab_size"])
    return DSparkConfig(
        block_size=int(raw["block_size"]),
        draft_offset=0 if raw.get("sample_from_anchor", kind == "dspark") else 1,
        target_layer_ids=[int(i) for i in raw["aux_hidden_state_layer_ids"]],
        num_draft_layers=int(layer["num_hidden_layers"]),
        hidden_size=layer["hidden_size"],
        intermediate_size=layer["intermediate_size"],
        num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer.get("num_key_value_heads") or layer["num_attention_heads"],
        head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", layer.get("rope_theta", 10000.0)),
        max_position_embeddings=layer.get("max_position_embeddings", 8192),
        qk_norm=True,
        attention_bias=bool(layer.get("attention_bias", False)),
        mask_token_id=int(raw["mask_token_id"]),
        head_type=head,
        head_rank=max(rank, 1),
        confidence_head=confidence,
        confidence_with_head=confidence and rank > 0 and bool(raw.get("confidence_head_with_markov", True)),
        draft_vocab_size=None if draft_vocab == vocab else draft_vocab,
        target_model_type=layer.get("model_type"),
        target_hidden_size=int(raw.get("target_hidden_size") or layer["hidden_size"]),
        target_vocab_size=vocab,
    )


def load_speculators(model_class, folder: str | Path, raw: dict, dtype: torch.dtype | None = None,
                     target_vocab_size=None):  # fmt: skip
    """Build a ``model_class`` draft from a ``speculators`` checkpoint folder; strict: every tensor must map."""
    folder = Path(folder)
    config = config_from_speculators(raw)
    extras = folder / EXTRAS
    decoding = {}
    if extras.is_file():
        for key, value in json.loads(extras.read_text()).items():
            if key in DecodingConfig.field_names():
                decoding[key] = value
            else:
                setattr(config, key, value)
    theirs = read_weights(folder)
    skip = (*TARGET_COPIES, "verifier_lm_head.weight", "verifier_norm.weight", "t2d", "d2t")  # lm_head: reduced
    mapped = rename_keys({k: v for k, v in theirs.items() if k not in skip}, _RENAMES)
    if config.draft_vocab_size is not None:
        if "d2t" not in theirs:
            raise ValueError(f"speculators checkpoint {folder}: draft_vocab_size is set but d2t is missing")
        ids = theirs["d2t"].long() + torch.arange(theirs["d2t"].shape[0])
        order = ids.argsort()  # ours is sorted by token id; theirs follows d2t
        mapped["draft_vocab"] = ids[order]
        if "t2d" in theirs and not torch.equal(theirs["t2d"].bool().nonzero()[:, 0], mapped["draft_vocab"]):
            raise ValueError(f"speculators checkpoint {folder}: t2d and d2t name different draft vocabularies")
        if "sequential_head.markov_w2.weight" in mapped:  # theirs holds the draft vocabulary's rows only: so do we
            mapped["sequential_head.markov_w2.weight"] = mapped["sequential_head.markov_w2.weight"][order]
            config.head_vocab = "draft"
    draft = load_mapped(model_class, folder, config, mapped, "speculators", dtype)
    draft.decoding = DecodingConfig.from_dict(decoding, str(extras))
    return draft


def export_speculators(draft, folder: str | Path, verifier: str | None = None) -> Path:
    """Write ``draft`` in the ``speculators`` layout (config.json, model.safetensors, hf_dspark.json) so that
    speculators' own classes, and vLLM, load it. ``verifier``: the target's Hub id, recorded for the serving engine
    (default: the attached target's ``name_or_path``, with a warning when that is a path on this machine).

    Needs a Qwen3-style draft (``qk_norm=True``), a ``mask_token_id``, a draft as wide as its target, and an
    attached target when the draft has a draft vocabulary (the reduced ``lm_head`` is part of the checkpoint).
    """
    c = draft.config
    problems = []
    if not c.qk_norm:
        problems.append("its decoder layers are Qwen3-style (per-head q/k RMSNorm): build the draft with qk_norm=True")
    if c.mask_token_id is None:
        problems.append(
            "it embeds mask slots with a vocabulary token: build the draft with mask_token_id=<a spare token id> "
            "instead of a learned mask vector"
        )
    if c.target_hidden_size is not None and c.target_hidden_size != c.hidden_size:
        problems.append(f"the draft must be as wide as its target ({c.hidden_size} vs {c.target_hidden_size})")
    if any(c.sliding_layers):
        problems.append("its sliding_attention layers have no counterpart there that this package has checked")
    if c.head_type != "none" and c.head_type not in _HEADS_OUT:
        problems.append(f"its sequential head {c.head_type!r} has no counterpart there ({sorted(_HEADS_OUT)} do)")
    if problems:
        raise ValueError("cannot export this draft in the speculators layout: " + "; ".join(problems))
    vocab = draft.draft_vocab
    if vocab is not None and not draft.is_attached:
        raise ValueError("attach the draft to its target first: the reduced lm_head is part of the checkpoint")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in draft.state_dict().items() if k != "draft_vocab"}
    weights = {k: v.detach().cpu().contiguous() for k, v in rename_keys(state, _RENAMES_OUT).items()}
    vocab_size = c.target_vocab_size
    if vocab is not None:
        ids = vocab.detach().cpu().long()
        if "markov_head.markov_w2.weight" in weights and c.head_vocab == "full":  # "draft": already these rows
            weights["markov_head.markov_w2.weight"] = weights["markov_head.markov_w2.weight"][ids].contiguous()
        weights["d2t"] = ids - torch.arange(ids.shape[0])
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[ids] = True
        weights["t2d"] = t2d
        weights["lm_head.weight"] = draft.borrowed.lm_head.weight.detach()[ids.to(draft.device)].cpu().contiguous()
    kind = "dflash" if c.head_type == "none" and not c.confidence_head else "dspark"
    name = verifier or (getattr(draft.target.config, "name_or_path", None) if draft.is_attached else None) or None
    if name is None or Path(name).expanduser().exists() or looks_like_path(name):
        warnings.warn(
            f"the exported config names the verifier {name!r}, "
            + ("which is a path on this machine" if name else "nothing")
            + ": a serving engine elsewhere cannot load it; pass verifier='<the target's Hub id>' (hf-dspark export "
            "--verifier ORG/NAME)",
            stacklevel=2,
        )
    layer = {
        "model_type": c.target_model_type or "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_draft_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "max_position_embeddings": c.max_position_embeddings,
        "attention_bias": c.attention_bias,
        "tie_word_embeddings": False,
    }
    raw = {
        "speculators_model_type": kind,
        "architectures": ["DSparkDraftModel" if kind == "dspark" else "DFlashDraftModel"],
        "transformer_layer_config": layer,
        "draft_vocab_size": int(vocab.shape[0]) if vocab is not None else vocab_size,
        "block_size": c.block_size,
        "aux_hidden_state_layer_ids": list(c.target_layer_ids),
        "mask_token_id": c.mask_token_id,
        "sample_from_anchor": c.draft_offset == 0,
        "sliding_window_non_causal": False,
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "dtype": str(draft.dtype).replace("torch.", ""),
        "speculators_config": {
            "algorithm": kind,
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": c.num_draft_tokens,
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {"name_or_path": name, "architectures": _architectures(draft)},
        },
    }
    if kind == "dspark":
        raw.update(
            markov_rank=0 if c.head_type == "none" else c.head_rank,
            markov_head_type=_HEADS_OUT.get(c.head_type, "vanilla"),
            enable_confidence_head=bool(c.confidence_head),
            confidence_head_with_markov=bool(c.confidence_head and c.confidence_with_head and c.head_type != "none"),
        )
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    # what the speculators config cannot say: the draft's calibration, its target's depth and every decoding setting
    extras = {"sts_temperatures": c.sts_temperatures, "target_num_layers": c.target_num_layers,
              **draft.decoding.to_dict()}  # fmt: skip
    (folder / EXTRAS).write_text(json.dumps(extras, indent=2) + "\n")
    return folder


def _architectures(draft) -> list[str]:
    if draft.is_attached:
        return list(getattr(draft.target.config, "architectures", None) or [type(draft.target).__name__])
    return []


FORMAT = register(
    CheckpointFormat("speculators", 20, "a speculators DSpark/DFlash draft (what vLLM serves)", is_speculators_config,
                     load_speculators, export_speculators)
)  # fmt: skip
