"""How ``target.generate`` reaches DSpark decoding.

The public way in is transformers' own extension point: ``target.generate(**inputs,
custom_generate=hf_dspark.dspark_generate, draft=draft)``. ``generate`` prepares the inputs, logits processors,
stopping criteria, generation config and cache as for any decoding method, then calls :func:`dspark_generate`,
which runs :func:`dspark_decode`. No transformers internals are touched on that route.

For ``target.generate(..., assistant_model=draft)`` (transformers has no registry for candidate generators),
:func:`enable` (called by ``import hf_dspark``) wraps two methods of ``GenerationMixin``:

- ``_validate_generation_mode``: when the assistant is a :class:`DSparkDraftModel`, check the draft against the
  target first (a draft for another target is refused by name, before transformers' generic vocabulary check);
- ``_assisted_decoding``: when the assistant is a :class:`DSparkDraftModel`, run :func:`dspark_decode` with the
  logits processors, stopping criteria, cache and streamer that ``generate`` already prepared.

Every other call goes to the original methods unchanged. :func:`disable` restores them.
"""

from __future__ import annotations

import functools
import inspect
import typing

from transformers.generation.utils import GenerationMixin

from ..decoding.loop import dspark_decode
from ..model.modeling_dspark import DSparkDraftModel
from ..settings import DecodingConfig

_ORIGINALS: dict[str, object] = {}


def _wrap_validate(original):
    @functools.wraps(original)
    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        draft = generation_mode_kwargs.get("assistant_model")
        if isinstance(draft, DSparkDraftModel):
            draft.check_target(self)
            if generation_config.num_beams not in (None, 1):
                raise ValueError("DSpark generation does not support beam search (num_beams must be 1).")
            for key in ("assistant_tokenizer",):
                if key in generation_mode_kwargs:
                    raise ValueError(f"`{key}` is not used by DSpark: the draft shares the target's tokenizer.")
        return original(self, generation_mode, generation_config, generation_mode_kwargs)

    return _validate_generation_mode


def _wrap_assisted(original):
    @functools.wraps(original)
    def _assisted_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
        draft = kwargs.get("assistant_model")
        if not isinstance(draft, DSparkDraftModel):
            return original(self, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs)
        kwargs.pop("assistant_model")
        for unused in ("inputs_tensor", "tokenizer", "assistant_tokenizer"):
            kwargs.pop(unused, None)
        return dspark_decode(
            self, input_ids, logits_processor, stopping_criteria, generation_config, draft=draft, **kwargs
        )

    return _assisted_decoding


def dspark_generate(
    model,
    input_ids,
    logits_processor,
    stopping_criteria,
    generation_config,
    draft: DSparkDraftModel | None = None,
    **model_kwargs,
):
    """DSpark decoding as a ``custom_generate`` callable: ``target.generate(**inputs,
    custom_generate=hf_dspark.dspark_generate, draft=draft, max_new_tokens=...)``.

    ``generate`` passes the prepared ``input_ids`` [R, P] (left-padded for a batch), logits processors, stopping
    criteria, generation config and model kwargs (attention mask, cache), plus the keywords this signature declares:
    ``draft``, and this call's decoding settings: one keyword for every field of
    :class:`~hf_dspark.settings.DecodingConfig` (the signature is generated from it: ``generate`` routes the
    keywords a ``custom_generate`` callable declares to it), ``None`` keeping the draft's own (``draft.decoding``,
    which the call never changes).
    Returns what :func:`dspark_decode` returns: sequences [R, P + new], or a ``DSparkGenerateOutput`` (with this
    call's ``dspark_stats``) with ``return_dict_in_generate=True``.

    Streamers: ``generate`` hands a ``custom_generate`` callable neither ``streamer=`` nor ``assistant_model=`` (both
    are its own arguments, and it has already put the prompt into the streamer). The streamer is taken from the
    ``generate`` call that called this function, so ``streamer=`` works as with any decoding method.
    """
    overrides = {name: model_kwargs.pop(name, None) for name in DecodingConfig.field_names()}
    if not isinstance(draft, DSparkDraftModel):
        raise ValueError(
            "custom_generate=hf_dspark.dspark_generate needs draft=<DSparkDraftModel> "
            f"(got {type(draft).__name__ if draft is not None else 'no draft'})"
        )
    draft.check_target(model)
    if generation_config.num_beams not in (None, 1):
        raise ValueError("DSpark generation does not support beam search (num_beams must be 1).")
    if generation_config.num_return_sequences not in (None, 1):
        raise ValueError("DSpark generation does not support num_return_sequences > 1.")
    settings = draft.decoding.resolve(draft.confidence is not None, **overrides)
    return dspark_decode(
        model, input_ids, logits_processor, stopping_criteria, generation_config, draft=draft,
        streamer=_callers_streamer(model), settings=settings, **model_kwargs,
    )  # fmt: skip


def settings_signature(function, before: str = "model_kwargs") -> inspect.Signature:
    """``function``'s signature with one keyword-only parameter per :class:`DecodingConfig` field (default
    ``None``: the draft's own setting; annotated with the field's type or ``None``), inserted before its ``**``
    parameter ``before``: the one place a new setting is declared is the dataclass."""
    params = list(inspect.signature(function).parameters.values())
    hints = typing.get_type_hints(DecodingConfig)
    settings = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=hints[name] | None)
        for name in DecodingConfig.field_names()
    ]
    at = next(i for i, p in enumerate(params) if p.name == before)
    return inspect.Signature(params[:at] + settings + params[at:])


dspark_generate.__signature__ = settings_signature(dspark_generate)


def _callers_streamer(model):
    """The ``streamer`` of the ``GenerationMixin.generate`` call on ``model`` that is running this callable.

    ``generate`` keeps it to itself: it puts the prompt into it, then calls a ``custom_generate`` callable without
    it, so a streamer given to ``generate`` would wait forever for the tokens. Its frame is the nearest one of a
    function named ``generate`` whose ``self`` is ``model``; ``tests/test_versions.py`` checks that this still
    finds it on every supported release.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name == "generate" and frame.f_locals.get("self") is model:
                return frame.f_locals.get("streamer")
            frame = frame.f_back
        return None
    finally:
        del frame


def enable() -> None:
    """Route ``generate(assistant_model=<DSparkDraftModel>)`` to DSpark decoding. Idempotent."""
    if _ORIGINALS:
        return
    for name, wrap in (("_validate_generation_mode", _wrap_validate), ("_assisted_decoding", _wrap_assisted)):
        original = getattr(GenerationMixin, name)
        _ORIGINALS[name] = original
        setattr(GenerationMixin, name, wrap(original))


def disable() -> None:
    """Restore transformers' own methods. Idempotent."""
    for name, original in _ORIGINALS.items():
        setattr(GenerationMixin, name, original)
    _ORIGINALS.clear()


def is_enabled() -> bool:
    return bool(_ORIGINALS)
