"""What a user reads when something is off: loading errors that name the path and the file, a draft that follows
its target to another dtype, statistics that exist before the first call, and refusals that say which option."""

import json
import os
import warnings

import pytest
import torch

import hf_dspark
from hf_dspark import DSparkDraftModel, DSparkStats
from hf_dspark.testing import tiny_target

IDS = torch.tensor([[5, 6, 7, 8, 9]])


@pytest.fixture
def pair():
    target = tiny_target("llama", vocab_size=96, eos_token_id=None)
    torch.manual_seed(0)
    return target, DSparkDraftModel.from_target(target, block_size=4, head_rank=8)


@pytest.fixture
def saved(pair, tmp_path):
    folder = tmp_path / "draft"
    pair[1].save_pretrained(folder)
    return folder


# ----- loading ------------------------------------------------------------------------------------------------


def test_a_missing_folder_is_named(tmp_path):
    missing = tmp_path / "no" / "such" / "draft"
    with pytest.raises(FileNotFoundError, match=f"^{missing}: no such folder"):
        DSparkDraftModel.from_pretrained(missing)
    with pytest.raises(FileNotFoundError, match=r"^\./draft-not-here: no such folder"):
        DSparkDraftModel.from_pretrained("./draft-not-here")


def test_a_name_that_is_neither_a_folder_nor_a_reachable_repo_is_named():
    with pytest.raises(
        FileNotFoundError, match=r"^someone/no-such-draft: no local folder of that name, and no Hub repo"
    ):
        DSparkDraftModel.from_pretrained("someone/no-such-draft", local_files_only=True)


def test_a_file_instead_of_a_folder_is_named(saved):
    with pytest.raises(FileNotFoundError, match=f"^{saved / 'config.json'} is a file: a draft checkpoint is a folder"):
        DSparkDraftModel.from_pretrained(saved / "config.json")


def test_a_folder_without_config_json_is_named(saved):
    os.remove(saved / "config.json")
    with pytest.raises(FileNotFoundError, match=f"^{saved} has no config.json: not a saved draft"):
        DSparkDraftModel.from_pretrained(saved)


def test_a_broken_config_json_is_named(saved):
    text = (saved / "config.json").read_text()
    (saved / "config.json").write_text(text[:40])
    with pytest.raises(ValueError, match=f"^{saved / 'config.json'} is not valid JSON"):
        DSparkDraftModel.from_pretrained(saved)
    (saved / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=f"^{saved / 'config.json'} holds a JSON list, not an object"):
        DSparkDraftModel.from_pretrained(saved)


def test_a_truncated_or_missing_weights_file_is_named(saved):
    weights = saved / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"^{weights} is not a readable safetensors file .*re-save or re-download"):
        DSparkDraftModel.from_pretrained(saved)
    weights.write_bytes(data[:5])  # not even a header
    with pytest.raises(ValueError, match=f"^{weights} is not a readable safetensors file"):
        DSparkDraftModel.from_pretrained(saved)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match=f"^{saved} has no model.safetensors"):
        DSparkDraftModel.from_pretrained(saved)
    index = {"metadata": {}, "weight_map": {"fc.weight": "model-00001-of-00002.safetensors"}}
    (saved / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=f"^{saved / 'model-00001-of-00002.safetensors'} is missing"):
        DSparkDraftModel.from_pretrained(saved)


def test_a_foreign_layout_with_a_damaged_file_is_named_too(tmp_path):
    """The checks run before every layout's loader, not only ours (here: a speculators-looking config)."""
    (tmp_path / "config.json").write_text(json.dumps({"speculators_model_type": "dspark"}))
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 3)
    with pytest.raises(ValueError, match=f"^{tmp_path / 'model.safetensors'} is not a readable safetensors file"):
        DSparkDraftModel.from_pretrained(tmp_path)


# ----- state ------------------------------------------------------------------------------------------------


def test_stats_come_with_each_call_and_the_draft_only_points_at_the_last(pair, saved):
    """Run-time statistics are each call's own (``dspark_stats`` on a dict output); the model keeps none of its own
    (a fresh or loaded draft has ``stats`` None) and ``draft.stats`` is only the last finished call's."""
    target, draft = pair
    for fresh in (draft, DSparkDraftModel.from_pretrained(saved)):
        assert fresh.stats is None
    ids = torch.tensor([[3, 7, 11, 5]])
    out = target.generate(ids, max_new_tokens=6, do_sample=False, assistant_model=draft, return_dict_in_generate=True)
    assert isinstance(out.dspark_stats, DSparkStats) and out.dspark_stats.rounds > 0
    assert draft.stats is out.dspark_stats
    assert len(out.dspark_stats.position_acceptance()) == draft.config.num_draft_tokens
    again = target.generate(ids, max_new_tokens=6, do_sample=False, assistant_model=draft, return_dict_in_generate=True)
    assert again.dspark_stats is not out.dspark_stats and draft.stats is again.dspark_stats


@pytest.mark.parametrize("route", ["assistant_model", "custom_generate"])
def test_a_target_moved_to_another_dtype_takes_its_draft_along(pair, route):
    target, draft = pair
    kwargs = {"assistant_model": draft} if route == "assistant_model" else {
        "custom_generate": hf_dspark.dspark_generate, "draft": draft}  # fmt: skip
    assert torch.equal(target.generate(IDS, max_new_tokens=12, **kwargs), target.generate(IDS, max_new_tokens=12))
    target.to(torch.float64)  # after attaching
    plain = target.generate(IDS, max_new_tokens=12)
    assert torch.equal(target.generate(IDS, max_new_tokens=12, **kwargs), plain)
    assert draft.dtype == torch.float64
    draft.to(torch.bfloat16)  # the draft alone moved: cast back to its target's dtype on the next call
    assert torch.equal(target.generate(IDS, max_new_tokens=12, **kwargs), plain)
    assert draft.dtype == torch.float64


def test_a_draft_that_follows_its_target_is_not_recast(pair):
    """The per-call check is a comparison, not a re-attach: nothing is rebuilt when nothing moved."""
    target, draft = pair
    assert draft.follows(target)
    assert not draft.follows(tiny_target("llama", vocab_size=96))
    target.half()
    assert not draft.follows(target)


# ----- refusals that name the option --------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["output_attentions", "output_hidden_states"])
@pytest.mark.parametrize("route", ["assistant_model", "custom_generate"])
def test_attentions_and_hidden_states_are_refused_by_name(pair, option, route):
    target, draft = pair
    kwargs = {"assistant_model": draft} if route == "assistant_model" else {
        "custom_generate": hf_dspark.dspark_generate, "draft": draft}  # fmt: skip
    with pytest.raises(ValueError, match=f"does not return attentions or hidden states \\({option}=True\\)"):
        target.generate(IDS, max_new_tokens=4, return_dict_in_generate=True, **{option: True}, **kwargs)


def test_assistant_model_after_disable_says_what_to_do(pair):
    target, draft = pair
    hf_dspark.disable()
    try:
        with pytest.raises(
            AttributeError, match=r"route is on .*hf_dspark.disable\(\) off, hf_dspark.enable\(\) on again"
        ):
            target.generate(IDS, max_new_tokens=4, assistant_model=draft)
        # the other route needs no wrapping
        out = target.generate(IDS, max_new_tokens=4, custom_generate=hf_dspark.dspark_generate, draft=draft)
        assert torch.equal(out, target.generate(IDS, max_new_tokens=4))
    finally:
        hf_dspark.enable()
    assert torch.equal(target.generate(IDS, max_new_tokens=4, assistant_model=draft), out)
    assert not hasattr(draft, "generation_config")  # still an AttributeError, for code that probes with hasattr


# ----- exports a user can serve elsewhere ---------------------------------------------------------------------


def test_speculators_export_names_the_verifier_by_hub_id_or_warns(tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_dspark.compat import export_speculators

    tiny_target("qwen3").save_pretrained(tmp_path / "target")
    local = AutoModelForCausalLM.from_pretrained(tmp_path / "target")
    draft = DSparkDraftModel.from_target(local, block_size=4, head_rank=8, qk_norm=True, mask_token_id=7)
    with pytest.warns(UserWarning, match=f"names the verifier '{tmp_path / 'target'}', which is a path on this"):
        export_speculators(draft, tmp_path / "a")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export_speculators(draft, tmp_path / "b", verifier="org/tiny-qwen3")
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-qwen3"


def test_the_embedded_target_is_named_by_the_hub_model_its_gguf_came_from():
    """What `hf-dspark export` records as the verifier for the embedded target (never a site-packages path)."""
    import importlib.util
    from types import SimpleNamespace

    from hf_dspark.embedded import GGUF_PACKAGE, HUB_ID, hub_id

    home = next(iter(importlib.util.find_spec(GGUF_PACKAGE).submodule_search_locations))
    assert HUB_ID == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert hub_id(SimpleNamespace(config=SimpleNamespace(name_or_path=home))) == HUB_ID
    assert hub_id(SimpleNamespace(config=SimpleNamespace(name_or_path="org/other"))) is None
