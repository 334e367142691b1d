"""Inputs the decoding loop cannot honour are refused by name; caches it cannot roll back are refused or, for
sliding-window targets, rolled back exactly (tested past the window)."""

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GenerationConfig,
    LogitsProcessorList,
    MistralConfig,
    MistralForCausalLM,
    StoppingCriteriaList,
)

from hf_dspark import DSparkDraftModel, dspark_generate
from hf_dspark.decoding.checks import check_finite
from hf_dspark.testing import tiny_target

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=None,
)


def _draft(target):
    torch.manual_seed(0)
    return DSparkDraftModel.from_target(target, block_size=4, head_rank=8)


def _call_directly(target, draft, **model_kwargs):
    """dspark_generate as generate would call it, with model kwargs transformers itself would not have checked."""
    ids = torch.tensor([[5, 6, 7, 8]])
    config = GenerationConfig(max_length=12, do_sample=False, pad_token_id=0)
    return dspark_generate(
        target, ids, LogitsProcessorList(), StoppingCriteriaList(), config, draft=draft, **model_kwargs
    )


def test_model_inputs_the_loop_cannot_honour_are_refused_by_name():
    from transformers import DynamicCache

    target = tiny_target("llama")
    draft = _draft(target)
    with pytest.raises(ValueError, match=r"cannot honour \['pixel_values', 'token_type_ids'\]"):
        _call_directly(
            target,
            draft,
            cache=DynamicCache(),
            token_type_ids=torch.zeros(1, 4, dtype=torch.long),
            pixel_values=torch.zeros(1, 3, 8, 8),
        )
    with pytest.raises(ValueError, match="needs use_cache=True"):
        _call_directly(target, draft, use_cache=False)
    with pytest.raises(ValueError, match="needs use_cache=True"):
        _call_directly(target, draft)  # no cache at all
    with pytest.raises(ValueError, match="counts positions from the attention mask"):
        target.generate(
            torch.tensor([[5, 6, 7, 8]]),
            position_ids=torch.tensor([[0, 2, 4, 6]]),
            max_new_tokens=4,
            custom_generate=dspark_generate,
            draft=draft,
        )
    out = target.generate(
        torch.tensor([[5, 6, 7, 8]]),
        position_ids=torch.tensor([[0, 1, 2, 3]]),
        max_new_tokens=4,
        custom_generate=dspark_generate,
        draft=draft,
        do_sample=False,
    )
    assert out.tolist() == target.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=4, do_sample=False).tolist()


def test_a_cache_that_cannot_be_cropped_is_refused():
    target = tiny_target("llama")
    draft = _draft(target)
    with pytest.raises(ValueError, match=r"needs a DynamicCache.*got StaticCache"):
        target.generate(
            torch.tensor([[5, 6, 7, 8]]),
            max_new_tokens=6,
            cache_implementation="static",
            custom_generate=dspark_generate,
            draft=draft,
        )


@pytest.mark.parametrize("arch", ["gemma2", "mistral"])
def test_sliding_window_target_decodes_exactly_past_its_window(arch):
    torch.manual_seed(0)
    if arch == "gemma2":
        target = Gemma2ForCausalLM(Gemma2Config(sliding_window=8, **SMALL)).eval()
    else:
        target = MistralForCausalLM(MistralConfig(sliding_window=8, **SMALL)).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(8)  # sharper logits: greedy not decided by float noise
    draft = _draft(target)
    draft.decoding.verify_mode = "fixed"
    g = torch.Generator().manual_seed(3)
    for length in (3, 11):
        ids = torch.randint(3, 96, (1, length), generator=g)
        ref = target.generate(ids, max_new_tokens=30, do_sample=False)
        out = target.generate(ids, max_new_tokens=30, do_sample=False, custom_generate=dspark_generate, draft=draft)
        assert out.tolist() == ref.tolist()
        assert sum(draft.stats.accepted) > 0 or sum(draft.stats.proposed) > 0
    batch = torch.randint(3, 96, (2, 5), generator=g)
    with pytest.raises(ValueError, match="sliding window of 8 tokens: a batch of 2 rows"):
        target.generate(
            batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=30,
            custom_generate=dspark_generate,
            draft=draft,
        )
    inside = target.generate(
        batch,
        attention_mask=torch.ones_like(batch),
        max_new_tokens=3,
        do_sample=False,
        custom_generate=dspark_generate,
        draft=draft,
    )
    ref = target.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=3, do_sample=False)
    assert inside.tolist() == ref.tolist()


def test_non_finite_target_logits_are_named():
    """A target whose logits turn NaN is refused by name, not by a failure deep in the scheduler or sampler."""
    target = tiny_target("llama")
    draft = _draft(target)
    forward = target.forward

    def nan_after_prefill(*args, **kwargs):
        out = forward(*args, **kwargs)
        if kwargs["input_ids"].shape[1] < 4:  # a verify block, not the prompt
            out.logits = torch.full_like(out.logits, float("nan"))
        return out

    target.forward = nan_after_prefill
    with pytest.raises(ValueError, match=r"non-finite logits \(NaN/inf\), which plain generate would return too"):
        target.generate(torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=8, custom_generate=dspark_generate, draft=draft)


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_one_non_finite_logit_in_a_verified_slot_is_refused(poison):
    """check_finite sums each position's logits instead of copying them out: one NaN, +inf or -inf anywhere in a
    verified slot still makes the call fail by name; the same value in a padding slot, or huge finite logits, do
    not."""
    logits = torch.randn(3, 4, 50, dtype=torch.float32) * 1e30  # finite, far from where a sum would overflow
    valid = torch.ones(3, 4, dtype=torch.bool)
    valid[1, 3] = False
    check_finite(logits, valid)
    logits[1, 3, 7] = poison
    check_finite(logits, valid)  # a padding slot's logits are never read
    logits[2, 1, 49] = poison
    with pytest.raises(ValueError, match=r"non-finite logits \(NaN/inf\)"):
        check_finite(logits, valid)
    with pytest.raises(ValueError, match=r"non-finite logits \(NaN/inf\)"):
        check_finite(logits[2, 1])


def test_gemma2_in_float64_over_left_padding():
    """Gemma 2's eager attention in float64 overflows on padding rows in transformers 5.2x and returns NaN logits
    for the real tokens too (plain generate's as well): then DSpark names the problem; where this release's target
    stays finite, DSpark's output equals plain generate's."""
    torch.manual_seed(0)
    target = Gemma2ForCausalLM(Gemma2Config(**SMALL)).to(torch.float64).eval()
    draft = _draft(target)
    ids = torch.tensor([[0, 0, 9, 10, 11], [12, 13, 14, 15, 16]])
    kw = dict(attention_mask=(ids != 0).long(), max_new_tokens=6, do_sample=False, pad_token_id=0)
    plain = target.generate(ids, output_logits=True, return_dict_in_generate=True, **kw)
    if any(step.isnan().any() for step in plain.logits):
        with pytest.raises(ValueError, match="non-finite logits"):
            target.generate(ids, custom_generate=dspark_generate, draft=draft, **kw)
    else:
        out = target.generate(ids, custom_generate=dspark_generate, draft=draft, **kw)
        assert out.tolist() == plain.sequences.tolist()
    ok = target.generate(ids[1:], max_new_tokens=6, do_sample=False, custom_generate=dspark_generate, draft=draft)
    assert ok.tolist() == target.generate(ids[1:], max_new_tokens=6, do_sample=False).tolist()


def test_from_pretrained_honours_subfolder(tmp_path):
    target = tiny_target("llama")
    draft = _draft(target)
    draft.save_pretrained(tmp_path / "drafts" / "v1")
    loaded = DSparkDraftModel.from_pretrained(tmp_path / "drafts", subfolder="v1")
    assert all(
        torch.equal(a, b) for a, b in zip(draft.state_dict().values(), loaded.state_dict().values(), strict=True)
    )


def test_from_pretrained_passes_download_options_to_the_layout_probe(monkeypatch, tmp_path):
    import huggingface_hub

    target = tiny_target("llama")
    _draft(target).save_pretrained(tmp_path / "snap" / "sub")
    seen = {}

    def fake_snapshot_download(repo_id, **kwargs):
        seen.update(kwargs, repo_id=repo_id)
        return str(tmp_path / "snap")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    from hf_dspark.compat import read_layout
    from hf_dspark.model.checkpoint_files import checkpoint_folder

    options = {"revision": "v2", "token": "t", "cache_dir": "c", "subfolder": "sub", "local_files_only": True}
    folder = checkpoint_folder("org/draft", options)
    assert read_layout(DSparkDraftModel, "org/draft", folder, options) is None  # our own layout
    assert seen == {
        "repo_id": "org/draft",
        "revision": "v2",
        "token": "t",
        "cache_dir": "c",
        "local_files_only": True,
        "allow_patterns": ["sub/*.json", "sub/*.safetensors"],
    }


def test_from_pretrained_fetches_a_hub_checkpoint_once_and_loads_that_folder(monkeypatch, tmp_path):
    """The layout probe's snapshot is the folder transformers loads: one fetch per call, with the download options,
    and the loaded draft still answers to the repo id it was asked for."""
    import huggingface_hub

    target = tiny_target("llama")
    draft = _draft(target)
    draft.decoding.verify_limit = 3
    draft.save_pretrained(tmp_path / "snap" / "sub")
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append(repo_id)
        return str(tmp_path / "snap")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    loaded = DSparkDraftModel.from_pretrained("org/draft", subfolder="sub", revision="v2", local_files_only=True)
    assert calls == ["org/draft"]
    assert loaded.name_or_path == "org/draft"
    assert loaded.decoding.verify_limit == 3
    assert all(
        torch.equal(a, b) for a, b in zip(draft.state_dict().values(), loaded.state_dict().values(), strict=True)
    )
