"""`DSparkConfig`: every field of a DSpark draft, checked on construction, plus the identity of its target."""

from __future__ import annotations

from transformers import PretrainedConfig

from ..settings import DecodingConfig
from .heads import HEADS

HEAD_VOCABS = ("full", "draft")
LAYER_TYPES = ("full_attention", "sliding_attention")


class DSparkConfig(PretrainedConfig):
    """Configuration of a DSpark draft model (see docs/method.md).

    Backbone:
        block_size (γ): slots per block, the anchor followed by γ-1 mask slots; every slot proposes one token.
        num_draft_layers, hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim,
        rms_norm_eps, rope_theta, max_position_embeddings, qk_norm (Qwen3-style per-head q/k RMSNorm),
        attention_bias: one draft decoder layer's shape. ``hidden_size`` equals the target's (shared LM head).
        layer_types: per draft layer, ``full_attention`` (sees all the context; the default) or
            ``sliding_attention`` (a block slot at position p sees context and block keys at positions q with
            |p - q| <= ``sliding_window``: transformers' bidirectional sliding window, as in its native DFlash
            drafters). ``None``: every layer full.
        sliding_window: the window of the ``sliding_attention`` layers, in tokens.
        target_layer_ids: target layers whose outputs (``hidden_states[l + 1]``) feed the draft context.
        mask_token_id: a reserved token id of the target's vocabulary used for the mask slots; ``None`` (the
            default) uses a learned ``mask_embedding`` vector instead, which works for any target.
        draft_offset: 0 for DSpark's convention (γ slots -> γ draft tokens, slot k proposes x_{k+1}); 1 for
            DFlash's (the anchor slot proposes nothing: γ slots -> γ-1 drafts, slot k proposes x_k).
    Heads:
        head_type: ``none`` (pure parallel, DFlash-style), ``markov``, ``gated`` (gated Markov) or ``rnn``.
        head_rank (r): rank of the Markov factorisation / size of the RNN state.
        confidence_head: whether to predict c_k, the probability that slot k survives verification.
        confidence_with_head: whether c_k also reads the head's W1[x_{k-1}] (DeepSpec's
            ``confidence_head_with_markov``), or h_k alone.
        sts_temperatures: per-position temperatures from sequential temperature scaling (``None``: uncalibrated).
        draft_vocab_size: propose only from a fixed subset of this many target tokens (the ``draft_vocab``
            buffer, set with ``DSparkDraftModel.set_draft_vocab``), so the draft's LM head reads that many rows
            instead of the whole vocabulary; ``None``: the whole vocabulary. Decoding stays lossless either way.
        head_vocab: the rows the sequential head's output matrix W2 stores: ``full`` (one per target token) or
            ``draft`` (one per draft-vocabulary token, in ``draft_vocab`` order; set with
            ``DSparkDraftModel.set_head_vocab``). Same proposals; ``draft`` drops (V - draft_vocab_size) × r
            parameters that a draft vocabulary never reads.
    Target identity (a draft refuses any other target):
        target_model_type, target_hidden_size, target_vocab_size, target_num_layers.
    Decoding settings (verify mode, lookup drafting, trees) are not part of this config: they live in
    ``draft.decoding`` (``hf_dspark.settings.DecodingConfig``, saved as ``decoding_config.json``). A config
    built with them (or read from a checkpoint written before the split) keeps them in ``legacy_decoding``, never
    serialised, and the draft built from it moves them across.
    Training:
        loss_decay: position weights w_k = exp(-(k-1)/loss_decay); ``None`` means γ.
    """

    model_type = "dspark"

    def __init__(
        self,
        block_size: int = 8,
        num_draft_layers: int = 1,
        target_layer_ids: list[int] | None = None,
        hidden_size: int = 64,
        intermediate_size: int = 128,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        head_dim: int | None = None,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 8192,
        layer_types: list[str] | None = None,
        sliding_window: int | None = None,
        qk_norm: bool = False,
        attention_bias: bool = False,
        mask_token_id: int | None = None,
        draft_offset: int = 0,
        head_type: str = "markov",
        head_rank: int = 256,
        confidence_head: bool = True,
        confidence_with_head: bool = True,
        sts_temperatures: list[float] | None = None,
        draft_vocab_size: int | None = None,
        head_vocab: str = "full",
        target_model_type: str | None = None,
        target_hidden_size: int | None = None,
        target_vocab_size: int | None = None,
        target_num_layers: int | None = None,
        loss_decay: float | None = None,
        initializer_range: float = 0.02,
        **kwargs,
    ):
        self.block_size = block_size
        self.num_draft_layers = num_draft_layers
        self.target_layer_ids = list(target_layer_ids) if target_layer_ids is not None else [0]
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.layer_types = list(layer_types) if layer_types is not None else None
        self.sliding_window = sliding_window
        self.qk_norm = qk_norm
        self.attention_bias = attention_bias
        self.mask_token_id = mask_token_id
        self.draft_offset = draft_offset
        self.head_type = head_type
        self.head_rank = head_rank
        self.confidence_head = confidence_head
        self.confidence_with_head = confidence_with_head
        self.sts_temperatures = list(sts_temperatures) if sts_temperatures is not None else None
        self.draft_vocab_size = draft_vocab_size
        self.head_vocab = head_vocab
        self.target_model_type = target_model_type
        self.target_hidden_size = target_hidden_size if target_hidden_size is not None else hidden_size
        self.target_vocab_size = target_vocab_size
        self.target_num_layers = target_num_layers
        self.loss_decay = loss_decay
        # Decoding settings given here (old checkpoints kept them in config.json) are checked and kept aside for
        # the draft to move into ``draft.decoding``; they are never written back into config.json.
        moved = {k: kwargs.pop(k) for k in DecodingConfig.field_names() if k in kwargs}
        self.legacy_decoding = DecodingConfig.from_legacy(moved).to_dict() if moved else None
        self.initializer_range = initializer_range
        # `generate` compares vocab sizes of target and assistant before it reaches us: keep this one honest.
        kwargs.setdefault("vocab_size", target_vocab_size)
        super().__init__(**kwargs)
        self.validate_fields()

    def validate_fields(self) -> None:
        """Raise ``ValueError`` naming the first field that cannot work."""
        head_types = ("none", *HEADS)  # read now: a head registered after import counts too
        if self.head_type not in head_types:
            raise ValueError(f"head_type must be one of {head_types}, got {self.head_type!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_draft_layers < 1:
            raise ValueError(f"num_draft_layers must be >= 1, got {self.num_draft_layers}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        self.validate_layer_types()
        if self.target_num_layers is not None and not all(
            0 <= i < self.target_num_layers for i in self.target_layer_ids
        ):
            raise ValueError(
                f"target_layer_ids {self.target_layer_ids} out of range for a {self.target_num_layers}-layer target"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_vocab not in HEAD_VOCABS:
            raise ValueError(f"head_vocab must be one of {HEAD_VOCABS}, got {self.head_vocab!r}")
        if self.head_vocab == "draft" and self.draft_vocab_size is None:
            raise ValueError("head_vocab='draft' stores W2's rows for a draft vocabulary: set draft_vocab_size too")
        if self.head_type != "none" and self.head_rank < 1:
            raise ValueError(f"head_rank must be >= 1 for head_type={self.head_type!r}")
        if self.draft_offset not in (0, 1):
            raise ValueError(f"draft_offset must be 0 (DSpark) or 1 (DFlash), got {self.draft_offset}")
        if self.block_size - self.draft_offset < 1:
            raise ValueError("a DFlash-convention block (draft_offset=1) needs block_size >= 2")
        if self.sts_temperatures is not None:
            if len(self.sts_temperatures) != self.num_draft_tokens:
                raise ValueError(
                    f"sts_temperatures has {len(self.sts_temperatures)} entries, "
                    f"the draft proposes {self.num_draft_tokens} tokens per block"
                )
            if any(t <= 0 for t in self.sts_temperatures):
                raise ValueError(f"sts_temperatures must be positive, got {self.sts_temperatures}")
        if self.draft_vocab_size is not None and not (
            1 <= self.draft_vocab_size <= (self.target_vocab_size or self.draft_vocab_size)
        ):
            raise ValueError(
                f"draft_vocab_size must be between 1 and the vocabulary size {self.target_vocab_size}, "
                f"got {self.draft_vocab_size}"
            )
        if self.target_vocab_size is not None and self.mask_token_id is not None:
            if not 0 <= self.mask_token_id < self.target_vocab_size:
                raise ValueError(f"mask_token_id {self.mask_token_id} outside the vocabulary")

    def validate_layer_types(self) -> None:
        """Raise ``ValueError`` unless ``layer_types`` is ``None`` or names one known kind per draft layer, and a
        sliding layer has an int ``sliding_window`` >= 1."""
        if self.layer_types is None:
            return
        if len(self.layer_types) != self.num_draft_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries, the draft has {self.num_draft_layers} layers"
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types: unknown kinds {unknown}; each must be one of {LAYER_TYPES}")
        window = self.sliding_window
        if "sliding_attention" in self.layer_types and (
            isinstance(window, bool) or not isinstance(window, int) or window < 1
        ):
            raise ValueError(f"sliding_attention layers need sliding_window, an int >= 1; got {window!r}")

    @property
    def sliding_layers(self) -> list[bool]:
        """Per draft layer, whether it attends through the sliding window."""
        return [kind == "sliding_attention" for kind in self.layer_types or ["full_attention"] * self.num_draft_layers]

    def __setattr__(self, name: str, value) -> None:
        if name in DecodingConfig.field_names():
            raise AttributeError(_moved(name))
        super().__setattr__(name, value)

    def __getattr__(self, name: str):
        if name in DecodingConfig.field_names():
            raise AttributeError(_moved(name))
        return super().__getattribute__(name)

    def to_dict(self) -> dict:
        out = super().to_dict()
        out.pop("legacy_decoding", None)
        return out

    @property
    def num_draft_tokens(self) -> int:
        """Tokens proposed per block: γ for DSpark, γ - 1 for the DFlash convention."""
        return self.block_size - self.draft_offset

    @property
    def num_target_features(self) -> int:
        return len(self.target_layer_ids)


def _moved(name: str) -> str:
    return (
        f"{name} is a decoding setting, not part of the draft's config: set draft.decoding.{name} (saved as "
        f"decoding_config.json), or pass {name}= to generate for one call"
    )
