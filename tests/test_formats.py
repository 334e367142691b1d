"""The registry of checkpoint formats: detection order, error text, the CLI's choices, and a format added from
outside the package (one module's worth of code) loading through ``from_pretrained``."""

import json

import pytest
import torch

from hf_dspark import DSparkConfig, DSparkDraftModel
from hf_dspark.cli import build_parser
from hf_dspark.compat import FORMATS, CheckpointFormat, detect, exportable, register
from hf_dspark.compat.common import load_mapped, read_weights
from hf_dspark.testing import tiny_target


def test_formats_are_listed_in_detection_order():
    assert list(FORMATS) == ["dspark", "speculators", "deepspec", "dflash", "muse_glimmer"]
    assert exportable() == ["dspark", "speculators", "deepspec"]
    assert detect({"model_type": "dspark"}).name == "dspark"
    assert detect({"architectures": ["DFlashDraftModel"]}).name == "dflash"
    assert detect({"model_type": "llama"}) is None


def test_the_cli_offers_the_exportable_formats():
    (export,) = [a for a in build_parser()._subparsers._group_actions[0].choices["export"]._actions
                 if a.dest == "format"]  # fmt: skip
    assert list(export.choices) == exportable() and export.default == "speculators"


def test_a_name_is_registered_once():
    with pytest.raises(ValueError, match="'deepspec' is already registered"):
        register(CheckpointFormat("deepspec", 99, "again", lambda raw: False))


def test_formats_are_asked_in_priority_order_whatever_order_they_register_in(monkeypatch):
    """Detection order is each format's own priority, not the order its module happened to be imported in."""
    monkeypatch.setattr("hf_dspark.compat.registry.FORMATS", dict(FORMATS))
    from hf_dspark.compat import registry

    broad = register(CheckpointFormat("broad", 35, "any llama-typed config", lambda r: r.get("model_type") == "llama"))
    assert list(registry.FORMATS) == ["dspark", "speculators", "deepspec", "broad", "dflash", "muse_glimmer"]
    assert registry.detect({"model_type": "llama"}) is broad
    narrow = register(CheckpointFormat("narrow", 1, "a llama config with a tag", lambda r: r.get("tag") == 1))
    assert registry.detect({"model_type": "llama", "tag": 1}) is narrow  # registered last, asked first


def test_an_unknown_layout_names_every_registered_format(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="unknown checkpoint layout") as err:
        DSparkDraftModel.from_pretrained(tmp_path)
    for fmt in FORMATS.values():
        assert f"{fmt.description} ({fmt.name})" in str(err.value)


def test_a_format_added_from_outside_loads_through_from_pretrained(tmp_path, monkeypatch):
    """What a contributor writes for a new layout: a detector and a loader over the shared helpers, registered."""
    target = tiny_target("llama")
    torch.manual_seed(0)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    draft.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "model_type": "toy_draft"}))
    (tmp_path / "decoding_config.json").unlink()

    def load_toy(model_class, folder, raw, dtype=None, target_vocab_size=None):
        fields = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "transformers_version")}
        return load_mapped(model_class, folder, DSparkConfig(**fields), read_weights(folder), "toy", dtype)

    toy = CheckpointFormat("toy", 60, "a toy layout", lambda r: r.get("model_type") == "toy_draft", load_toy)
    monkeypatch.setitem(FORMATS, "toy", toy)
    back = DSparkDraftModel.from_pretrained(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), draft.state_dict().values(), strict=True))
    monkeypatch.delitem(FORMATS, "toy")
    with pytest.raises(ValueError, match="unknown checkpoint layout"):
        DSparkDraftModel.from_pretrained(tmp_path)
