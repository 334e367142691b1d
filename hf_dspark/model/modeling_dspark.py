"""`DSparkDraftModel`: the parallel backbone with KV injection plus its sequential and confidence heads
(docs/method.md, "Parallel backbone").

Read top to bottom: the model (context projection, block embedding, backbone forward), then the target wiring
(identity checks, shared embedding and LM head, ``from_target``), then checkpoints. The layers it stacks are in
``layers.py``; the draft vocabulary (a subset of the target's tokens to propose from) in ``vocabulary.py``.

Shapes: R rows, L context positions, γ = block_size, d = hidden_size, V = vocabulary, m = len(target_layer_ids).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

from ..settings import DECODING_CONFIG_NAME, DecodingConfig
from .checkpoint_files import checkpoint_folder
from .configuration_dspark import DSparkConfig
from .heads import ConfidenceHead, build_sequential_head
from .layers import DraftLayer, RMSNorm, rope_cos_sin
from .vocabulary import DraftVocabulary


@dataclass
class DSparkOutput(ModelOutput):
    """Backbone output. logits: base logits U [R, γ', V]; hidden_states: h [R, γ', d] (after the final norm)."""

    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None


def check_vocab(name_or_path, model, vocab: int | None) -> None:
    """``ValueError`` naming both sizes when a loaded draft was built for another vocabulary than ``vocab``."""
    if vocab is not None and model.config.target_vocab_size != vocab:
        raise ValueError(
            f"{name_or_path} was built for a {model.config.target_vocab_size}-token vocabulary, "
            f"target_vocab_size={vocab} was asked for"
        )


class _TargetRef:
    """Holds the target's embedding and LM head without registering them as submodules of the draft (so they are
    neither saved in the draft's checkpoint nor counted among its parameters)."""

    def __init__(self, target: nn.Module):
        self.model = target
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()


class DSparkDraftModel(DraftVocabulary, PreTrainedModel):
    """A DSpark draft: γ slots (anchor + γ-1 masks) in, base logits and hidden states for γ draft tokens out.

    The draft owns its backbone, heads and (for targets without a mask token) a learned mask embedding. It borrows
    the target's embedding table and LM head at use time: call :meth:`attach` (``from_target`` does it for you).
    """

    config_class = DSparkConfig
    base_model_prefix = "dspark"
    main_input_name = "target_hidden_states"
    _no_split_modules = ("DraftLayer",)
    _supports_sdpa = True
    # Installed by ``hf_dspark/__init__.py`` from the layers above this package, which imports nothing above it:
    # ``read_layout(cls, name_or_path, folder, kwargs)`` is ``hf_dspark.compat``'s front door for every checkpoint
    # layout (-> a draft, or ``None`` for our own, which ``PreTrainedModel.from_pretrained`` reads);
    # ``write_hub_files(folder, repo_id)`` writes ``custom_generate/`` into a folder being pushed to the Hub.
    read_layout: ClassVar[Callable | None] = None
    write_hub_files: ClassVar[Callable | None] = None

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        c = config
        if c.target_vocab_size is None:
            raise ValueError(
                "DSparkConfig.target_vocab_size is required (build drafts with DSparkDraftModel.from_target)"
            )
        self.fc = nn.Linear(c.num_target_features * c.target_hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_draft_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.mask_token_id is None:
            self.mask_embedding = nn.Parameter(torch.zeros(c.hidden_size))
        self.sequential_head = build_sequential_head(c)
        feature = c.head_rank if self.sequential_head is not None and c.confidence_with_head else 0
        self.confidence = ConfidenceHead(c.hidden_size, feature) if c.confidence_head else None
        if c.draft_vocab_size is not None:
            self.register_buffer("draft_vocab", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        else:
            self.draft_vocab = None
        self._vocab_rows: dict | None = None  # name -> (key, value) of _cached, rebuilt on any change
        self._target: _TargetRef | None = None
        # How to decode (decoding_config.json): defaults that every generate call may override for itself.
        self.decoding = DecodingConfig.from_dict(c.legacy_decoding, "config") if c.legacy_decoding else DecodingConfig()
        self.stats = None  # the last finished generate call's DSparkStats (each call returns its own: dspark_stats)
        self.sps_profile = None  # hf_dspark.scheduling.policy.SPSProfile set by the user; overrides the measured ones
        self.head_enabled = True  # False: propose from the parallel backbone alone (demo toggle, ablations)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        if module is self and self.config.mask_token_id is None:
            nn.init.normal_(self.mask_embedding, std=std)
        if module is self.sequential_head:
            # The sequential head starts neutral: the draft begins as its parallel backbone.
            nn.init.zeros_(module.output_weight)

    # ----- the target it borrows from -------------------------------------------------------------------------

    @property
    def borrowed(self) -> _TargetRef:
        """What the draft borrows from its target (``model``, ``embed_tokens``, ``lm_head``); ``RuntimeError`` when
        it is not attached."""
        if self._target is None:
            raise RuntimeError("This draft is not attached to a target: call draft.attach(target) first.")
        return self._target

    @property
    def target(self) -> nn.Module:
        return self.borrowed.model

    def check_target(self, target: nn.Module) -> None:
        """Raise ``ValueError`` naming each field where ``target`` differs from the target this draft was built for."""
        tc = target.config.get_text_config()
        c = self.config
        expected = {
            "model_type": (c.target_model_type, tc.model_type),
            "hidden_size": (c.target_hidden_size, tc.hidden_size),
            "vocab_size": (c.target_vocab_size, tc.vocab_size),
            "num_hidden_layers": (c.target_num_layers, tc.num_hidden_layers),
        }
        wrong = [
            f"{k}: draft expects {a}, target has {b}" for k, (a, b) in expected.items() if a is not None and a != b
        ]
        if wrong:
            raise ValueError("This DSpark draft was built for another target (" + "; ".join(wrong) + ").")

    def attach(self, target: nn.Module) -> DSparkDraftModel:
        """Check ``target`` and borrow its embedding and LM head. Returns ``self``.

        The draft follows the target's floating dtype and device: a draft stored in bfloat16 (as shipped drafts are)
        and attached to a float32 target is cast to float32 here, since the two exchange hidden states every round.
        Every ``generate`` call checks this again (:meth:`follows`), so a target moved with ``target.to(...)`` after
        attaching takes its draft along on the next call.
        """
        self.check_target(target)
        weight = target.get_input_embeddings().weight
        if weight.dtype.is_floating_point and self.dtype != weight.dtype:
            self.to(weight.dtype)
        if self.device != weight.device:
            self.to(weight.device)
        self._target = _TargetRef(target)
        self._vocab_rows = None
        return self

    def follows(self, target: nn.Module) -> bool:
        """Whether this draft is attached to ``target`` and in its current floating dtype and on its device."""
        if self._target is None or self._target.model is not target:
            return False
        weight = target.get_input_embeddings().weight
        dtype_ok = not weight.dtype.is_floating_point or self.dtype == weight.dtype
        return dtype_ok and self.device == weight.device

    def __setattr__(self, name: str, value) -> None:
        if name == "decoding" and not isinstance(value, DecodingConfig):  # the loop reads it at every call
            raise TypeError(
                f"draft.decoding must be a DecodingConfig (e.g. draft.decoding.replace(verify_mode='fixed')), "
                f"got {type(value).__name__}"
            )
        super().__setattr__(name, value)

    def __getattr__(self, name: str):
        if name == "generation_config":  # what transformers' own assisted decoding reads first from an assistant
            raise AttributeError(
                "a DSparkDraftModel is not one of transformers' assistant models and has no generation_config: "
                "generate(assistant_model=draft) runs DSpark only while hf_dspark's route is on (`import hf_dspark` "
                "turns it on, hf_dspark.disable() off, hf_dspark.enable() on again); or call "
                "target.generate(**inputs, custom_generate=hf_dspark.dspark_generate, draft=draft)"
            )
        return super().__getattr__(name)

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., d] -> base logits [..., V] over the full vocabulary; with a draft vocabulary only its rows are
        computed and every other token gets -inf."""
        if self.draft_vocab is None:
            return self.lm_head(h)
        sub = self.draft_vocab_logits(h)
        full = sub.new_full((*sub.shape[:-1], self.config.target_vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_vocab, sub)

    @property
    def is_attached(self) -> bool:
        return self._target is not None

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        return self.borrowed.lm_head(h)

    # ----- backbone -------------------------------------------------------------------------------------------

    def fuse_context(self, target_hidden_states: torch.Tensor) -> torch.Tensor:
        """W_c [H^{l_1}; …; H^{l_m}], the context input before its RMSNorm: [R, L, m·d_t] -> [R, L, d]."""
        return self.fc(target_hidden_states)

    def fuse_layer_into(self, fused: torch.Tensor, slot: int, hidden: torch.Tensor) -> None:
        """Add tapped layer ``slot``'s share of :meth:`fuse_context`, W_c[:, slot·d_t:(slot+1)·d_t] H^{l_slot}, to
        ``fused`` [R, L, d] in place (hidden [R, L, d_t]). Summed over the slots this is ``fuse_context`` of the
        concatenation, so a decoding loop need never hold the m tapped layers of a long prompt at once."""
        d_t = self.config.target_hidden_size
        weight = self.fc.weight[:, slot * d_t : (slot + 1) * d_t]
        flat = fused.view(-1, fused.shape[-1])
        flat.addmm_(hidden.reshape(-1, d_t).to(fused.dtype), weight.t().to(fused.dtype))

    def context_key_values(self, target_hidden_states: torch.Tensor, positions: torch.Tensor):
        """Per-layer keys/values of newly committed context: [R, L, m·d_t], positions [R, L] -> [(k, v)] per layer,
        each [R, KV, L, head_dim]. Callers cache these and extend them each round."""
        return self.fused_key_values(self.fuse_context(target_hidden_states), positions)

    def fused_key_values(self, fused: torch.Tensor, positions: torch.Tensor):
        """:meth:`context_key_values` from the fused context [R, L, d] (:meth:`fuse_context`'s output)."""
        h = self.hidden_norm(fused)
        rope = self.rope(positions)
        return [layer.self_attn.key_values(h, rope) for layer in self.layers]

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [R, 1, L, head_dim] of ``positions`` [R, L] in float64, computed once a forward: every layer
        rotates with the same ones, cast to its own activations' dtype (the values it computed for itself before)."""
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, torch.float64)

    def embed_block(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """anchor_ids [...] -> block inputs [..., γ, d]: the anchor's embedding then γ-1 mask embeddings."""
        embed = self.borrowed.embed_tokens
        anchor = embed(anchor_ids).to(self.dtype)
        if self.config.mask_token_id is None:
            mask = self.mask_embedding.to(anchor.dtype)
        else:
            mask = embed(torch.tensor(self.config.mask_token_id, device=anchor_ids.device)).to(anchor.dtype)
        masks = mask.expand(*anchor.shape[:-1], self.config.block_size - 1, -1)
        return torch.cat([anchor.unsqueeze(-2), masks], dim=-2)

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        context: list[tuple[torch.Tensor, torch.Tensor]],
        attention_mask: torch.Tensor | None = None,
        compute_logits: bool = True,
        context_positions: torch.Tensor | None = None,
    ) -> DSparkOutput:
        """One backbone pass.

        Args:
            block_embeds: [R, N, d] block inputs (N = γ for one block, A·γ for A blocks packed in training).
            block_positions: [R, N] true sequence positions of the block slots.
            context: per-layer cached context keys/values from :meth:`context_key_values`, each [R, KV, L, hd].
            attention_mask: [R, N, L + N] bool (True = may attend), or ``None`` for one block that sees all
                context and itself bidirectionally.
            context_positions: [R, L] sequence positions of the context entries; needed (and only read) by a draft
                with ``sliding_attention`` layers.
        Returns:
            :class:`DSparkOutput` with ``hidden_states`` h [R, N, d] and base ``logits`` U [R, N, V].
        """
        if len(context) != len(self.layers):
            raise ValueError(f"context has {len(context)} layers, the draft has {len(self.layers)}")
        masks = self.layer_masks(block_positions, context_positions, attention_mask)
        x, rope = block_embeds, self.rope(block_positions)
        for layer, (k, v), mask in zip(self.layers, context, masks, strict=True):
            x = layer(x, rope, k, v, mask)
        h = self.norm(x)
        return DSparkOutput(logits=self.draft_logits(h) if compute_logits else None, hidden_states=h)

    def layer_masks(self, block_positions, context_positions, attention_mask) -> list[torch.Tensor | None]:
        """The attention mask of each layer: ``attention_mask`` for full layers; for sliding ones, also keys at
        most ``sliding_window`` positions from the query (both directions, as transformers' bidirectional sliding
        window). Shapes as in :meth:`forward`."""
        sliding = self.config.sliding_layers
        if not any(sliding):
            return [attention_mask] * len(sliding)
        if context_positions is None:
            raise ValueError("this draft has sliding_attention layers: forward needs context_positions [R, L]")
        key_positions = torch.cat([context_positions.to(block_positions.device), block_positions], dim=1)
        near = (block_positions[:, :, None] - key_positions[:, None, :]).abs() <= self.config.sliding_window
        windowed = near if attention_mask is None else attention_mask & near
        return [windowed if s else attention_mask for s in sliding]

    # ----- construction from a target -------------------------------------------------------------------------

    @staticmethod
    def default_target_layer_ids(num_target_layers: int, num_features: int = 5) -> list[int]:
        """Spread ``num_features`` layers from layer 1 to L-3 (DFlash's rule), or over all layers of tiny targets."""
        lo, hi = (1, num_target_layers - 3) if num_target_layers >= 6 else (0, num_target_layers - 1)
        n = min(num_features, hi - lo + 1)
        if n == 1:
            return [hi]
        return sorted({round(lo + i * (hi - lo) / (n - 1)) for i in range(n)})

    @classmethod
    def from_target(cls, target: nn.Module, copy_target_layers: bool = False, **overrides) -> DSparkDraftModel:
        """A randomly initialised draft shaped after ``target`` and attached to it.

        The draft's layers take the target's width, heads and RoPE base; ``overrides`` set any config field.
        ``copy_target_layers`` initialises draft layer i from the target's top layers (a good start for training).
        """
        tc = target.config.get_text_config()
        rope = getattr(tc, "rope_parameters", None) or {}
        fields = dict(
            hidden_size=tc.hidden_size,
            intermediate_size=tc.intermediate_size,
            num_attention_heads=tc.num_attention_heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0)),
            max_position_embeddings=getattr(tc, "max_position_embeddings", 8192),
            qk_norm=tc.model_type.startswith("qwen3"),
            attention_bias=getattr(tc, "attention_bias", False),
            target_model_type=tc.model_type,
            target_hidden_size=tc.hidden_size,
            target_vocab_size=tc.vocab_size,
            target_num_layers=tc.num_hidden_layers,
        )
        fields.update(overrides)
        if "target_layer_ids" not in overrides:
            fields["target_layer_ids"] = cls.default_target_layer_ids(tc.num_hidden_layers)
        config = DSparkConfig(**fields)
        draft = cls(config).to(device=target.device, dtype=target.dtype)
        if copy_target_layers:
            draft._copy_target_layers(target)
        return draft.attach(target)

    def _copy_target_layers(self, target: nn.Module) -> None:
        decoder = target.get_decoder()
        if getattr(decoder, "norm", None) is not None and decoder.norm.weight.shape == self.norm.weight.shape:
            self.norm.weight.data.copy_(decoder.norm.weight)  # the shared LM head expects the target's final norm
        layers = decoder.layers
        top = layers[len(layers) - len(self.layers) :]
        for mine, theirs in zip(self.layers, top, strict=True):
            theirs_sd = theirs.state_dict()
            sd = {
                k: theirs_sd[k]
                for k, v in mine.state_dict().items()
                if k in theirs_sd and theirs_sd[k].shape == v.shape
            }
            mine.load_state_dict(sd, strict=False)

    # ----- checkpoints ----------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs) -> DSparkDraftModel:
        """Load a draft like any Hub model, but strictly: a checkpoint with missing, unexpected or mis-shaped
        tensors raises ``ValueError`` naming them (never a silently re-initialised draft).

        The loaded draft is not attached to a target; ``generate(assistant_model=draft)`` attaches it, or call
        :meth:`attach`.

        Other layouts load too (DeepSpec, z-lab DFlash, speculators, transformers' ``MuseGlimmerAssistantModel``).
        A ``MuseGlimmerAssistantModel`` checkpoint does not record its target's vocabulary: pass
        ``target_vocab_size=target.config.get_text_config().vocab_size``. For every other layout that argument is a
        check: a draft built for another vocabulary raises ``ValueError`` naming both sizes.
        """
        # a Hub id is fetched here, once; the layout probe and transformers' loader then read that folder
        folder = checkpoint_folder(pretrained_model_name_or_path, kwargs)
        kwargs.pop("subfolder", None)  # applied: ``folder`` is the checkpoint itself
        foreign = cls.read_layout(cls, pretrained_model_name_or_path, folder, kwargs) if cls.read_layout else None
        if foreign is not None:
            return foreign
        vocab = kwargs.pop("target_vocab_size", None)  # a check here, never a config override
        want_info = kwargs.pop("output_loading_info", False)
        kwargs["ignore_mismatched_sizes"] = True  # collected and reported below, with names
        model, info = super().from_pretrained(folder, *args, output_loading_info=True, **kwargs)
        model.name_or_path = model.config._name_or_path = str(pretrained_model_name_or_path)  # not the cache path
        problems = []
        if info.get("missing_keys"):
            problems.append(f"missing tensors {sorted(info['missing_keys'])}")
        if info.get("unexpected_keys"):
            problems.append(f"unexpected tensors {sorted(info['unexpected_keys'])}")
        if info.get("mismatched_keys"):
            shapes = [f"{k} (checkpoint {tuple(a)}, expected {tuple(b)})" for k, a, b in info["mismatched_keys"]]
            problems.append(f"mis-shaped tensors {shapes}")
        if info.get("error_msgs"):
            problems.append("; ".join(info["error_msgs"]))
        if problems:
            raise ValueError(f"Malformed DSpark checkpoint {pretrained_model_name_or_path}: " + "; ".join(problems))
        check_vocab(pretrained_model_name_or_path, model, vocab)
        if (folder / DECODING_CONFIG_NAME).is_file():  # else a checkpoint from before the split: config.json's
            model.decoding = DecodingConfig.from_pretrained(folder)
        return (model, info) if want_info else model

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Like ``PreTrainedModel.save_pretrained``, always safetensors; the borrowed target weights are not saved.
        Inside :meth:`push_to_hub` it also writes ``custom_generate/`` for the repository being pushed to."""
        kwargs["safe_serialization"] = True
        result = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            self.decoding.save_pretrained(save_directory)
        repo_id = getattr(self, "_pushing_to", None)
        if repo_id is not None and kwargs.get("is_main_process", True) and self.write_hub_files is not None:
            self.write_hub_files(save_directory, repo_id)
        return result

    def push_to_hub(self, repo_id: str, *args, **kwargs):
        """``PreTrainedModel.push_to_hub``, plus ``custom_generate/`` so that ``target.generate(**inputs,
        custom_generate=repo_id, trust_remote_code=True)`` decodes with this draft."""
        self._pushing_to = repo_id
        try:
            return super().push_to_hub(repo_id, *args, **kwargs)
        finally:
            del self._pushing_to
