"""How to decode lives apart from what the weights compute: ``draft.decoding`` / ``decoding_config.json``."""

import inspect
import json

import pytest
import torch

from hf_dspark import DecodingConfig, DSparkConfig, DSparkDraftModel, dspark_generate
from hf_dspark.settings import DECODING_CONFIG_NAME, resolve_mode
from hf_dspark.testing import tiny_target


def _draft(target, **overrides):
    torch.manual_seed(0)
    return DSparkDraftModel.from_target(target, block_size=4, head_rank=8, **overrides)


def test_save_writes_decoding_apart_from_the_weights_config(tmp_path):
    target = tiny_target("llama")
    draft = _draft(target)
    draft.decoding.verify_mode, draft.decoding.lookup_max_ngram, draft.decoding.tree_top_k = "threshold", 3, 2
    draft.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert not set(config) & set(DecodingConfig.field_names())
    saved = json.loads((tmp_path / DECODING_CONFIG_NAME).read_text())
    assert saved == {**DecodingConfig().to_dict(), "verify_mode": "threshold", "lookup_max_ngram": 3, "tree_top_k": 2}
    back = DSparkDraftModel.from_pretrained(tmp_path)
    assert back.decoding == draft.decoding and back.decoding is not draft.decoding


def test_a_checkpoint_from_before_the_split_loads_with_its_settings_moved_across(tmp_path):
    target = tiny_target("llama")
    draft = _draft(target)
    draft.save_pretrained(tmp_path)
    (tmp_path / DECODING_CONFIG_NAME).unlink()
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(verify_mode="fixed", verify_limit=3, lookup_max_ngram=2, lookup_adaptive=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    old = DSparkDraftModel.from_pretrained(tmp_path)
    want = DecodingConfig(verify_mode="fixed", verify_limit=3, lookup_max_ngram=2, lookup_adaptive=True)
    assert old.decoding == want
    ids = torch.tensor([[5, 6, 7, 5, 6]])
    ref = target.generate(ids, max_new_tokens=12, do_sample=False)
    out = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=old.attach(target))
    assert out.tolist() == ref.tolist() and max(old.stats.proposed) <= 3  # the moved verify_limit is obeyed
    old.save_pretrained(tmp_path / "again")  # saving again completes the move
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert not set(again) & set(DecodingConfig.field_names())
    assert DecodingConfig.from_pretrained(tmp_path / "again") == want
    with pytest.raises(ValueError, match="verify_mode must be one of"):  # an old config with a bad value is named
        DSparkConfig(**{**config, "verify_mode": "greedy"})


def test_decoding_fields_on_the_weights_config_say_where_they_went():
    draft = _draft(tiny_target("llama"))
    with pytest.raises(AttributeError, match=r"verify_mode is a decoding setting.*draft\.decoding\.verify_mode"):
        draft.config.verify_mode = "fixed"
    with pytest.raises(AttributeError, match=r"tree_top_k is a decoding setting.*pass tree_top_k= to generate"):
        _ = draft.config.tree_top_k
    assert draft.decoding.verify_mode == "auto"  # nothing was set


def test_resolve_applies_overrides_and_resolves_auto_once():
    saved = DecodingConfig(lookup_max_ngram=3)
    assert saved.resolve(True).verify_mode == "scheduled" and saved.resolve(False).verify_mode == "fixed"
    assert resolve_mode("auto", True) == "scheduled" and resolve_mode("threshold", False) == "threshold"
    call = saved.resolve(True, verify_mode="fixed", verify_limit=None, lookup_max_ngram=0)
    assert (call.verify_mode, call.verify_limit, call.lookup_max_ngram) == ("fixed", None, 0)  # None keeps
    assert saved == DecodingConfig(lookup_max_ngram=3)  # the defaults are never changed by a call
    with pytest.raises(ValueError, match=r"unknown DSpark decoding settings \['verify_modes'\]"):
        saved.resolve(True, verify_modes="fixed")
    with pytest.raises(ValueError, match="needs a confidence head"):
        saved.resolve(False, verify_mode="async")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"verify_mode": "greedy"}, "verify_mode must be one of"),
        ({"verify_limit": 1.5}, "verify_limit must be an int from 0 to 256"),
        ({"confidence_threshold": 2}, r"confidence_threshold must lie in \[0, 1\]"),
        ({"verify_layout": "ragged"}, "verify_layout must be one of"),
        ({"confidence_recalibration": 1}, "confidence_recalibration must be True or False"),
        ({"greedy_lookahead": "yes"}, "greedy_lookahead must be True or False"),
        ({"cost_recalibration": 0}, "cost_recalibration must be True or False"),
        ({"verify_buckets": "on"}, "verify_buckets must be True or False"),
        ({"lookup_max_ngram": 2, "lookup_min_ngram": 3}, "lookup_min_ngram must be an int between 1 and"),
        ({"lookup_max_tokens": 0}, "lookup_max_tokens must be an int from 1 to 256"),
        ({"tree_top_k": True}, "tree_top_k must be an int from 1 \\(a chain\\) to 256"),
    ],
)
def test_every_field_is_checked_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        DecodingConfig(**fields)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"verify_mode": "greedy"}, "verify_mode must be one of"),
        ({"verify_limit": -1}, "verify_limit must be an int from 0 to 256"),
        ({"confidence_threshold": 2}, r"confidence_threshold must lie in \[0, 1\]"),
        ({"tree_top_k": 0}, "tree_top_k must be an int from 1 \\(a chain\\) to 256"),
        ({"lookup_max_ngram": 3, "lookup_min_ngram": 4}, "lookup_min_ngram must be an int between 1 and"),
        ({"lookup_adaptive": "yes"}, "lookup_adaptive must be True or False"),
    ],
)
def test_an_assigned_setting_is_checked_at_once_and_the_old_value_kept(fields, message):
    """``draft.decoding.tree_top_k = 0`` fails where it is written, with the message a call would give, not at the
    next ``generate``; the setting keeps its previous value."""
    draft = _draft(tiny_target("llama"))
    *first, (name, value) = fields.items()
    for good_name, good_value in first:  # valid on their own: accepted
        setattr(draft.decoding, good_name, good_value)
    kept = draft.decoding.to_dict()
    with pytest.raises(ValueError, match=message):
        setattr(draft.decoding, name, value)
    assert draft.decoding.to_dict() == kept
    draft.decoding.verify_mode = "fixed"  # a valid assignment still goes through
    assert draft.decoding.verify_mode == "fixed"


def test_an_unknown_setting_or_a_foreign_object_is_refused_on_assignment():
    draft = _draft(tiny_target("llama"))
    with pytest.raises(
        AttributeError, match=r"'verify_modes' is not a DSpark decoding setting; known: \['verify_mode'"
    ):
        draft.decoding.verify_modes = "fixed"
    with pytest.raises(TypeError, match=r"draft.decoding must be a DecodingConfig .* got dict"):
        draft.decoding = {"verify_mode": "fixed"}
    draft.decoding = draft.decoding.replace(lookup_max_ngram=4, lookup_min_ngram=3)  # several at once
    assert (draft.decoding.lookup_max_ngram, draft.decoding.lookup_min_ngram) == (4, 3)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"verify_mode": "fixed", "speed": 2}', r"unknown decoding settings \['speed'\]"),
        ('{"tree_top_k": 0}', "tree_top_k must be an int from 1 \\(a chain\\) to 256"),
    ],
)
def test_a_malformed_decoding_config_is_named(tmp_path, text, message):
    draft = _draft(tiny_target("llama"))
    draft.save_pretrained(tmp_path)
    (tmp_path / DECODING_CONFIG_NAME).write_text(text)
    with pytest.raises(ValueError, match=f"{DECODING_CONFIG_NAME}.*{message}"):
        DSparkDraftModel.from_pretrained(tmp_path)


def test_custom_generate_takes_every_decoding_field_per_call():
    params = inspect.signature(dspark_generate).parameters
    assert set(DecodingConfig.field_names()) <= set(params)
    assert all(params[name].default is None for name in DecodingConfig.field_names())
    target = tiny_target("llama")
    draft = _draft(target)
    ids = torch.tensor([[5, 6, 7, 8]])
    ref = target.generate(ids, max_new_tokens=10, do_sample=False)
    out = target.generate(ids, max_new_tokens=10, do_sample=False, custom_generate=dspark_generate, draft=draft,
                          verify_mode="fixed", verify_limit=2, verify_layout="packed")  # fmt: skip
    assert out.tolist() == ref.tolist() and max(draft.stats.proposed) == 2
    assert draft.decoding == DecodingConfig()
