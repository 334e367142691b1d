"""What DSpark decoding refuses, by name, before it starts: inputs it cannot honour and caches it cannot roll back.

A decoding method that ignored an input would return a silent wrong answer; these checks turn each such case into
an error that says what to change.
"""

from __future__ import annotations

import weakref

import torch
from transformers.generation import GenerationConfig

# model kwargs generate prepares that the loop honours itself (positions: from the attention mask, as generate does)
HONOURED_MODEL_KWARGS = {"attention_mask", "cache", "past_key_values", "use_cache", "logits_to_keep", "position_ids"}


def check_supported(generation_config: GenerationConfig, input_ids: torch.Tensor, model_kwargs: dict, streamer):
    R = input_ids.shape[0]
    asked = [k for k in ("output_attentions", "output_hidden_states") if model_kwargs.get(k) or getattr(
        generation_config, k, False)]  # fmt: skip
    if asked:
        raise ValueError(
            f"DSpark generation does not return attentions or hidden states ({' and '.join(asked)}=True): the "
            "target's forward passes verify several draft tokens at once, so there is no per-token step to report"
        )
    unsupported = sorted(k for k, v in model_kwargs.items() if k not in HONOURED_MODEL_KWARGS and v is not None)
    if unsupported:
        raise ValueError(
            f"DSpark generation cannot honour {unsupported}: it drafts and verifies from input_ids, the attention "
            "mask and the cache alone (multimodal inputs, token_type_ids and other model inputs are not supported)"
        )
    if model_kwargs.get("use_cache") is False:
        raise ValueError("DSpark generation needs use_cache=True (a cache the verifier can crop).")
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("DSpark generation needs input_ids (inputs_embeds is not supported).")
    if R > 1 and streamer is not None:
        raise ValueError("streamers need batch size 1 (rows of a DSpark batch advance by different amounts)")
    if (
        R > 1
        and generation_config.return_dict_in_generate
        and (generation_config.output_scores or generation_config.output_logits)
    ):
        raise ValueError("output_scores/output_logits with DSpark need batch size 1")


def check_settings_fit(settings, draft) -> None:
    """Refuse, before anything is measured, settings that ask for more than ``draft`` can propose: ``tree_top_k``
    children per node out of the tokens the draft proposes (its draft vocabulary, else the target's)."""
    vocab = draft.draft_vocab
    proposable = int(vocab.numel()) if vocab is not None else int(draft.config.target_vocab_size)
    if settings.tree_top_k > proposable:
        raise ValueError(
            f"tree_top_k={settings.tree_top_k} asks for more children per node than the {proposable} tokens this "
            "draft can propose (its draft vocabulary)"
        )


def check_finite(logits: torch.Tensor, valid: torch.Tensor | None = None) -> None:
    """Refuse non-finite target logits [..., V] (at the positions ``valid`` [...] marks, when given) by name instead
    of failing later in the scheduler or sampler.

    A position's logits are all finite iff their float32 sum is: one inf or NaN makes the sum inf or NaN, and finite
    logits would have to reach ~1e34 for a sum over a vocabulary to overflow. The sum accumulates in float32 whatever
    the logits' dtype: a float16 sum overflows past 65,504 (SmolLM2's logits reach ~38, a row sums to ~455,000), which
    refused every float16 target. The sum reads the logits once; selecting the valid positions first copied them,
    5 ms a round for 8 rows of 9 slots on SmolLM2 here."""
    sums = logits.sum(-1, dtype=torch.float64 if logits.dtype == torch.float64 else torch.float32)
    if not bool(torch.isfinite(sums if valid is None else sums[valid]).all()):
        raise ValueError(
            "the target returned non-finite logits (NaN/inf), which plain generate would return too: e.g. Gemma 2's "
            "eager attention in float64 overflows on the fully masked rows of left padding and spreads NaN to the "
            "real tokens. Use float32, bfloat16 or float16, or prompts without padding."
        )


def sliding_window(cache) -> int | None:
    """The smallest sliding window among the cache's layers (``None``: no sliding-window layer)."""
    windows = [layer.sliding_window for layer in getattr(cache, "layers", []) if getattr(layer, "is_sliding", False)]
    return min(windows) if windows else None


def check_cache(cache, rows: int, max_length: int) -> None:
    """Refuse, by name, the caches the verifier cannot roll back exactly."""
    from transformers import DynamicCache

    if cache is None:
        raise ValueError("DSpark generation needs use_cache=True (a cache the verifier can crop).")
    if not isinstance(cache, DynamicCache):
        raise ValueError(
            f"DSpark generation needs a DynamicCache, which it crops after each verify; got {type(cache).__name__} "
            "(leave cache_implementation unset)"
        )
    window = sliding_window(cache)
    if window is not None and not hasattr(cache, "activate_past_recording"):
        raise ValueError("this transformers release cannot roll back a sliding-window cache (activate_past_recording)")
    if window is not None and rows > 1 and max_length > window:
        # rejected slots of one row are holes that count toward the window in a batch, unlike in plain generate
        raise ValueError(
            f"the target attends through a sliding window of {window} tokens: a batch of {rows} rows can decode "
            f"DSpark only within it (max_length {max_length} > {window}); run the rows one at a time"
        )


_TREE_MASKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> {(impl, dtype): honours a tree mask}


def tree_refusal(target, cache) -> str | None:
    """Why ``target`` cannot verify a token tree in one forward (``None``: it can). A tree needs a custom 4D
    attention mask over a plain ``DynamicCache``: sliding-window layers would apply their window to the mask's
    columns, not to positions, and attention kernels other than eager and SDPA take no such mask. Whether the model
    honours the mask is measured once per target (:func:`honours_tree_mask`), not assumed from its family."""
    from transformers.cache_utils import DynamicLayer

    if sliding_window(cache) is not None:
        return "the target has sliding-window attention layers"
    impl = target.config._attn_implementation
    if impl not in ("eager", "sdpa"):
        return f"attn_implementation={impl!r} takes no custom 4D attention mask (use 'sdpa' or 'eager')"
    if any(type(layer) is not DynamicLayer for layer in getattr(cache, "layers", [None])):
        return f"the cache's layers are not plain DynamicLayers ({type(cache).__name__})"
    known = _TREE_MASKS.setdefault(target, {})
    key = (impl, target.dtype)
    if key not in known:
        known[key] = honours_tree_mask(target)
    return None if known[key] else "the target does not honour a custom 4D attention mask (measured)"


@torch.no_grad()
def honours_tree_mask(target) -> bool:
    """Whether ``target`` computes a branch of a tree under a 4D mask as it computes the same tokens in sequence:
    tokens (a, b, c) at positions (0, 1, 1), c attending to a and itself only, must give c the logits that (a, c)
    gives it at position 1 (and b those of (a, b))."""
    vocab = target.config.get_text_config().vocab_size
    device, dtype = target.device, target.dtype
    ids = torch.tensor([[1, 2, 3]], device=device) % vocab
    allowed = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool, device=device)
    mask = torch.zeros(3, 3, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    positions = torch.tensor([[0, 1, 1]], device=device)
    tree = target(input_ids=ids, position_ids=positions, attention_mask=mask[None, None], use_cache=False).logits[0]
    chains = [target(input_ids=ids[:, [0, j]], use_cache=False).logits[0, -1] for j in (1, 2)]
    expected = torch.stack(chains).float()
    scale = float(expected.abs().max()) + 1.0
    tolerance = scale * (1e-4 if dtype in (torch.float32, torch.float64) else 3e-2)
    return bool((tree[1:].float() - expected).abs().max() <= tolerance)


def keep_cache_slots(cache, start: int, slots: torch.Tensor) -> None:
    """Keep, of every layer's cache entries from ``start`` on, only ``slots`` [R, n] (per row, indices past
    ``start``), in that order: after a tree's verify, each row's accepted path (padded with any slot; the caller's
    attention mask marks the padding as holes). The kept entries are written over the verified block's own columns
    and the rest is cropped, so the committed prefix is not copied each round (the cache's own update already
    copies it once per forward)."""
    index = slots[:, None, :, None]
    for layer in cache.layers:
        for name in ("keys", "values"):
            entries = getattr(layer, name)
            kept = entries[:, :, start:].gather(2, index.expand(-1, entries.shape[1], -1, entries.shape[3]))
            entries[:, :, start : start + kept.shape[2]] = kept
            setattr(layer, name, entries[:, :, : start + kept.shape[2]])
