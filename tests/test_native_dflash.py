"""transformers' own DFlash drafters (``MuseGlimmerAssistantModel``) on our loop, against transformers' own loop.

The peer is the oracle: the same random target and drafter, built with transformers' classes, decode greedily with
``generate(assistant_model=drafter, speculation_type="dflash")`` and with our loop (fixed full-block verify) on the
checkpoint ``from_pretrained`` reads; tokens and the accepted count of every round must be equal. Their counts are
read from outside, by wrapping ``DFlashTokenCandidateGenerator.update_candidate_strategy`` (called once per round
with the number of accepted drafts).
"""

import json

import pytest
import torch
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM

from hf_dspark import DSparkDraftModel, dspark_generate

if not hasattr(transformers, "MuseGlimmerAssistantModel"):
    pytest.skip(
        f"transformers {transformers.__version__} has no native DFlash drafter (5.25+)", allow_module_level=True
    )

from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

NEW_TOKENS = 40
# (vocabulary, seed, block size, sliding window): small vocabularies so that random drafts are accepted often enough
# to exercise partial and full acceptance; the windows are far shorter than the 50-token sequences
CASES = [(8, 1, 5, 6), (8, 2, 5, 6), (16, 0, 5, 6), (16, 2, 4, 3), (8, 1, 3, 2)]


def pair(vocab: int, seed: int, block: int, window: int, layer_types=("sliding_attention", "full_attention")):
    """(target, drafter, prompt): a random Qwen3 target and a random native drafter reading its layers 0 and 2."""
    torch.manual_seed(seed)
    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    ids = dict(bos_token_id=None, eos_token_id=None, pad_token_id=0)
    target = Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, num_hidden_layers=4, max_position_embeddings=512,
                                          tie_word_embeddings=False, **shape, **ids)).eval()  # fmt: skip
    with torch.no_grad():
        target.lm_head.weight.mul_(4)  # sharper than the default init: greedy paths not decided by float noise
    config = MuseGlimmerAssistantConfig(num_hidden_layers=len(layer_types), block_size=block, mask_token_id=vocab - 1,
                                        target_layer_ids=[0, 2], sliding_window=window, layer_types=list(layer_types),
                                        **shape, **ids)  # fmt: skip
    drafter = MuseGlimmerAssistantModel(config).eval()
    return target, drafter, torch.randint(1, vocab - 1, (1, 10))


def native_dflash(target, drafter, prompt, monkeypatch) -> tuple[list[int], list[int]]:
    """transformers' own DFlash decoding: (token ids, accepted drafts per round)."""
    counts = []
    original = DFlashTokenCandidateGenerator.update_candidate_strategy

    def recording(self, input_ids, scores, num_matches):
        counts.append(int(num_matches))
        return original(self, input_ids, scores, num_matches)

    monkeypatch.setattr(DFlashTokenCandidateGenerator, "update_candidate_strategy", recording)
    out = target.generate(prompt, assistant_model=drafter, speculation_type="dflash", max_new_tokens=NEW_TOKENS,
                          do_sample=False)  # fmt: skip
    monkeypatch.undo()
    return out[0].tolist(), counts[1:]  # the first call follows the prefill, which verified no drafts


def ours(target, draft, prompt) -> tuple[list[int], list[int]]:
    draft.decoding.verify_mode = "fixed"
    out = target.generate(prompt, custom_generate=dspark_generate, draft=draft, max_new_tokens=NEW_TOKENS,
                          do_sample=False)  # fmt: skip
    return out[0].tolist(), list(draft.stats.accepted)


@pytest.mark.parametrize("vocab,seed,block,window", CASES)
def test_same_tokens_and_accepted_counts_as_transformers_native_loop(tmp_path, monkeypatch, vocab, seed, block, window):
    target, drafter, prompt = pair(vocab, seed, block, window)
    drafter.save_pretrained(tmp_path)
    draft = DSparkDraftModel.from_pretrained(tmp_path, target_vocab_size=vocab)
    assert draft.config.num_draft_tokens == block - 1 and draft.config.sliding_layers == [True, False]
    their_tokens, their_counts = native_dflash(target, drafter, prompt, monkeypatch)
    our_tokens, our_counts = ours(target, draft, prompt)
    assert our_tokens == their_tokens == target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)[0].tolist()
    assert our_counts == their_counts


def test_the_cases_exercise_acceptance_and_the_window(tmp_path):
    """Guards the identity test: its cases accept partial and full blocks, and the sliding window changes what is
    accepted (a draft that ignored the window would fail there)."""
    accepted = []
    for vocab, seed, block, window in CASES:
        target, drafter, prompt = pair(vocab, seed, block, window)
        drafter.save_pretrained(tmp_path / str(seed))
        draft = DSparkDraftModel.from_pretrained(tmp_path / str(seed), target_vocab_size=vocab)
        counts = ours(target, draft, prompt)[1]
        accepted += counts
        if (vocab, seed) == (16, 2):
            draft.config.layer_types = None  # every layer full: the window is ignored
            assert ours(target, draft, prompt)[1] != counts
    assert 0 < min(a for a in accepted if a) < max(accepted) and max(accepted) == 4  # partial and whole blocks


def test_batched_rows_equal_plain_greedy(tmp_path):
    """Left-padded rows of different lengths: the window counts true positions, not cache slots."""
    target, drafter, _ = pair(16, 0, 5, 3)
    drafter.save_pretrained(tmp_path)
    draft = DSparkDraftModel.from_pretrained(tmp_path, target_vocab_size=16)
    prompts = [torch.randint(1, 15, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 12)]
    ids = torch.zeros(2, 12, dtype=torch.long)
    mask = torch.zeros(2, 12, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, -len(p) :], mask[r, -len(p) :] = p, 1
    out = target.generate(ids, attention_mask=mask, custom_generate=dspark_generate, draft=draft, max_new_tokens=24,
                          do_sample=False)  # fmt: skip
    for r, p in enumerate(prompts):
        plain = target.generate(p[None], max_new_tokens=24, do_sample=False)[0, len(p) :]
        assert out[r, 12:].tolist() == plain.tolist()


def test_the_loaded_draft_saves_and_reloads_in_our_layout(tmp_path):
    target, drafter, prompt = pair(8, 1, 5, 6)
    drafter.save_pretrained(tmp_path / "native")
    draft = DSparkDraftModel.from_pretrained(tmp_path / "native", target_vocab_size=8)
    draft.save_pretrained(tmp_path / "ours")
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert saved["model_type"] == "dspark" and saved["sliding_window"] == 6
    assert saved["layer_types"] == ["sliding_attention", "full_attention"] and saved["draft_offset"] == 1
    again = DSparkDraftModel.from_pretrained(tmp_path / "ours")
    assert ours(target, again, prompt) == ours(target, draft, prompt)


def _write_native(tmp_path, **changes):
    _, drafter, _ = pair(8, 1, 5, 6)
    drafter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    "changes,kwargs,message",
    [
        ({}, {}, "does not record its target's vocabulary: pass target_vocab_size="),
        ({}, {"target_vocab_size": 4}, "mask_token_id 7 outside the vocabulary"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, {"target_vocab_size": 8},
         "MuseGlimmerAssistantModel with rope_type 'yarn': only the default RoPE is supported"),
        ({"hidden_act": "gelu"}, {"target_vocab_size": 8}, "with hidden_act 'gelu': only silu is supported"),
        ({"layer_types": ["sliding_attention", "chunked_attention"]}, {"target_vocab_size": 8},
         r"layer_types: unknown kinds \['chunked_attention'\]"),
        ({"layer_types": ["sliding_attention"]}, {"target_vocab_size": 8},
         "layer_types has 1 entries, the draft has 2"),
        ({"sliding_window": None}, {"target_vocab_size": 8}, "sliding_attention layers need sliding_window"),
    ],
)  # fmt: skip
def test_native_checkpoints_it_cannot_reproduce_are_refused_by_name(tmp_path, changes, kwargs, message):
    folder = _write_native(tmp_path, **changes)
    with pytest.raises(ValueError, match=message):
        DSparkDraftModel.from_pretrained(folder, **kwargs)


def test_sliding_layers_need_the_context_positions(tmp_path):
    _, drafter, _ = pair(8, 1, 5, 6)
    drafter.save_pretrained(tmp_path)
    draft = DSparkDraftModel.from_pretrained(tmp_path, target_vocab_size=8)
    context = [(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16))] * 2
    with pytest.raises(ValueError, match=r"sliding_attention layers: forward needs context_positions \[R, L\]"):
        draft(torch.zeros(1, 5, 64), torch.arange(3, 8)[None], context)


def test_exports_refuse_sliding_layers(tmp_path):
    """Neither export layout can say that a layer attends through a window: refused, not silently widened."""
    from hf_dspark.compat import export_deepspec, export_speculators

    target, drafter, _ = pair(8, 1, 5, 6)
    drafter.save_pretrained(tmp_path / "native")
    draft = DSparkDraftModel.from_pretrained(tmp_path / "native", target_vocab_size=8).attach(target)
    with pytest.raises(ValueError, match="sliding_attention layers have no counterpart"):
        export_speculators(draft, tmp_path / "speculators", verifier="org/target")
    with pytest.raises(ValueError, match="DeepSpec's layout has no sliding-window layers"):
        export_deepspec(draft, tmp_path / "deepspec")
    assert not (tmp_path / "speculators").exists() and not (tmp_path / "deepspec").exists()


def test_side_by_side_benchmark_runs_and_reports_identity(tmp_path):
    """benchmarks/native_dflash.py at toy size: its report says the two loops agreed and names theirs' refusal."""

    from benchmarks.native_dflash import main

    readme = tmp_path / "results.md"
    report = main(["--out", str(tmp_path), "--reps", "1", "--new-tokens", "8", "--samples", "20",
                   "--readme", str(readme)])  # fmt: skip
    assert report["batch1"]["identical_tokens"] and report["batch1"]["identical_accepted_counts"]
    assert report["batch4"]["identical_to_plain"]
    assert report["batch4"]["transformers_dflash"].startswith("ValueError: assisted generate is only supported for")
    assert set(report["sampling"]["p_values"]["T=0.7"]) == {"transformers_dflash", "hf_dspark"}
    assert json.loads((tmp_path / "native_dflash.json").read_text())["batch1"]["rounds"] == report["batch1"]["rounds"]
    assert "| batch 4 | ✓ | refused |" in readme.read_text()


def test_cli_reads_native_drafters_with_the_targets_vocabulary(tmp_path):
    """The CLI loads every draft with the target in hand and names its vocabulary, so a native drafter needs no
    extra option; a DFlash-convention draft is refused by DeepSpec's export and written by speculators'."""
    from hf_dspark.cli import main

    target, drafter, _ = pair(8, 1, 5, 6, layer_types=("full_attention", "full_attention"))
    target.save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "native")
    common = ["export", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "native")]
    main([*common, "--out", str(tmp_path / "spec"), "--format", "speculators", "--verifier", "org/target"])
    back = DSparkDraftModel.from_pretrained(tmp_path / "spec")
    assert back.config.draft_offset == 1 and back.config.target_vocab_size == 8
    with pytest.raises(SystemExit, match=r"DFlash's convention \(draft_offset=1\): export it with export_speculators"):
        main([*common, "--out", str(tmp_path / "ds"), "--format", "deepspec"])


def test_a_draft_loaded_for_another_vocabulary_is_refused(tmp_path):
    """``target_vocab_size`` checks our own layout (never overrides its config)."""
    target, _, _ = pair(8, 1, 5, 6)
    DSparkDraftModel.from_target(target, block_size=4, head_rank=8).save_pretrained(tmp_path)
    assert DSparkDraftModel.from_pretrained(tmp_path, target_vocab_size=8).config.target_vocab_size == 8
    with pytest.raises(ValueError, match="was built for a 8-token vocabulary, target_vocab_size=9 was asked for"):
        DSparkDraftModel.from_pretrained(tmp_path, target_vocab_size=9)
