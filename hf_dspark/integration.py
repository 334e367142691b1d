"""How ``target.generate(..., assistant_model=draft)`` reaches DSpark decoding.

transformers 5.x has no registry for candidate generators, so :func:`enable` (called by ``import hf_dspark``)
wraps two methods of ``GenerationMixin``:

- ``_validate_generation_mode``: when the assistant is a :class:`DSparkDraftModel`, check the draft against the
  target first (a draft for another target is refused by name, before transformers' generic vocabulary check);
- ``_assisted_decoding``: when the assistant is a :class:`DSparkDraftModel`, run :func:`dspark_decode` with the
  logits processors, stopping criteria, cache and streamer that ``generate`` already prepared.

Every other call goes to the original methods unchanged. :func:`disable` restores them.
"""

from __future__ import annotations

import functools

from transformers.generation.utils import GenerationMixin

from .generation import dspark_decode
from .modeling_dspark import DSparkDraftModel

_ORIGINALS: dict[str, object] = {}


def _wrap_validate(original):
    @functools.wraps(original)
    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        draft = generation_mode_kwargs.get("assistant_model")
        if isinstance(draft, DSparkDraftModel):
            draft.check_target(self)
            if generation_config.num_beams != 1:
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
