"""What hf-dspark relies on in transformers, checked on the installed release (CI runs this file on the oldest
supported release too), so a release that changes it fails here by name rather than somewhere downstream."""

import inspect

import transformers
from transformers import LlamaForCausalLM
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin

from hf_dspark.decoding.versions import CACHE_FIELD, OLDEST_SUPPORTED, cache_argument

RELEASE = f"transformers {transformers.__version__}"
# what generate passes every decoding method first (and so dspark_generate and the wrapped _assisted_decoding)
DECODING_METHOD = ["self", "input_ids", "logits_processor", "stopping_criteria", "generation_config"]


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_release_is_in_the_supported_range():
    from packaging.version import Version

    assert Version(transformers.__version__) >= Version(OLDEST_SUPPORTED), RELEASE


def test_custom_generate_callables_get_declared_keywords_and_the_prepared_arguments():
    """dspark_generate relies on generate calling a callable as (model, input_ids, logits_processor,
    stopping_criteria, generation_config, **declared keywords, **model kwargs) and dropping `streamer`."""
    source = inspect.getsource(GenerationMixin.generate)
    assert "custom_generate" in _params(GenerationMixin.generate), RELEASE
    assert "isinstance(custom_generate, Callable)" in source, f"{RELEASE}: callables no longer accepted"
    extract = inspect.getsource(GenerationMixin._extract_generation_mode_kwargs)
    assert "inspect.signature(custom_generate)" in extract, f"{RELEASE}: declared keywords no longer passed"
    assert _params(GenerationMixin._sample)[:5] == DECODING_METHOD, RELEASE
    # the streamer is read from generate's frame (dspark_generate._callers_streamer)
    assert {"self", "streamer"} <= set(_params(GenerationMixin.generate)), RELEASE


def test_the_assistant_model_hook_wraps_methods_that_still_exist_with_their_signatures():
    """`import hf_dspark` wraps these two; if a release renames or reshapes them, assistant_model=draft breaks."""
    assert _params(GenerationMixin._validate_generation_mode) == [
        "self",
        "generation_mode",
        "generation_config",
        "generation_mode_kwargs",
    ], RELEASE
    assert _params(GenerationMixin._assisted_decoding)[:5] == DECODING_METHOD, RELEASE


def test_cache_names_agree_with_this_release():
    fields = {f for f in GenerateDecoderOnlyOutput.__dataclass_fields__}
    assert CACHE_FIELD in fields, RELEASE
    assert cache_argument(LlamaForCausalLM) in _params(LlamaForCausalLM.forward), RELEASE
