"""What differs between the transformers releases hf-dspark supports (5.17 to the newest), in one place.

transformers 5.2x renamed the KV cache argument of models and ``generate`` outputs from ``past_key_values`` to
``cache`` (the old name is still accepted by ``generate`` with a deprecation warning). Everything else the decoding
loop uses is the same across the range; ``tests/test_versions.py`` checks these assumptions on the installed
release, so a release that changes them fails by name.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

from transformers.generation.utils import GenerateDecoderOnlyOutput

OLDEST_SUPPORTED = "5.17.0"

# the name generate's outputs and the decoding methods' model kwargs give the cache
CACHE_FIELD = (
    "cache" if "cache" in {f.name for f in dataclasses.fields(GenerateDecoderOnlyOutput)} else "past_key_values"
)


@functools.cache
def cache_argument(model_class: type) -> str:
    """The keyword a model's ``forward`` takes its KV cache under: ``cache`` (5.2x) or ``past_key_values``."""
    params = inspect.signature(model_class.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise ValueError(f"{model_class.__name__}.forward takes no KV cache argument (cache / past_key_values)")


def cache_from(model_kwargs: dict):
    """The cache ``generate`` prepared for a decoding method, under either name (``None`` if there is none)."""
    cache = model_kwargs.get("cache")
    return cache if cache is not None else model_kwargs.get("past_key_values")


@functools.cache
def takes_logits_to_keep(model_class: type) -> bool:
    """Whether ``model_class.forward`` takes ``logits_to_keep`` (a forward that needs no logits then skips them)."""
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters
