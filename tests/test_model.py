"""DSparkConfig / DSparkDraftModel: construction, checkpoints, heads, and the errors users see."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel

from hf_dspark import DSparkConfig, DSparkDraftModel
from hf_dspark.model.heads import soft_acceptance_label
from hf_dspark.testing import tiny_target


def test_from_target_wires_identity_and_shapes():
    target = tiny_target("qwen3", layers=6)
    draft = DSparkDraftModel.from_target(target, block_size=5, num_draft_layers=2, head_rank=16)
    c = draft.config
    assert (c.target_model_type, c.target_hidden_size, c.target_vocab_size, c.target_num_layers) == ("qwen3", 32, 96, 6)
    assert c.target_layer_ids == DSparkDraftModel.default_target_layer_ids(6) == [1, 2, 3]
    assert c.qk_norm and c.head_dim == 8
    assert draft.fc.weight.shape == (32, 3 * 32)
    # the target's embedding and LM head are borrowed, not owned
    names = set(draft.state_dict())
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)
    assert draft.is_attached and draft.target is target


def test_default_target_layer_ids_follow_dflash_rule():
    assert DSparkDraftModel.default_target_layer_ids(36) == [1, 9, 17, 25, 33]  # DeepSpec's Qwen3-8B choice
    assert DSparkDraftModel.default_target_layer_ids(30) == [1, 8, 14, 20, 27]
    assert DSparkDraftModel.default_target_layer_ids(2) == [0, 1]


def test_backbone_output_shapes():
    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=6, head_rank=8)
    feats = torch.randn(1, 7, len(draft.config.target_layer_ids) * 32)
    ctx = draft.context_key_values(feats, torch.arange(7)[None])
    assert ctx[0][0].shape == (1, 2, 7, 8)
    out = draft(draft.embed_block(torch.tensor([5])), torch.arange(7, 13)[None], ctx)
    assert out.logits.shape == (1, 6, 96) and out.hidden_states.shape == (1, 6, 32)


def _perturbed_draft(target, **overrides):
    """A γ=4 draft whose every weight is moved off its initial value (so a lost tensor would show)."""
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8, **overrides)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p))
    return draft


@pytest.mark.parametrize("head", ["none", "markov", "gated", "rnn"])
def test_save_load_round_trip_is_exact(tmp_path, head):
    target = tiny_target("llama")
    draft = _perturbed_draft(target, head_type=head)
    draft.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "decoding_config.json", "model.safetensors"]
    loaded = DSparkDraftModel.from_pretrained(tmp_path)
    strip = lambda d: {k: v for k, v in d.items() if k != "_name_or_path"}  # noqa: E731
    assert strip(loaded.config.to_dict()) == strip(draft.config.to_dict())
    a, b = draft.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # and through the Auto classes
    assert isinstance(AutoConfig.from_pretrained(tmp_path), DSparkConfig)
    assert isinstance(AutoModel.from_pretrained(tmp_path), DSparkDraftModel)
    # it generates identically once attached
    ids = torch.tensor([[5, 6, 7, 8]])
    kw = dict(max_new_tokens=12, do_sample=False)
    assert target.generate(ids, assistant_model=loaded, **kw).tolist() == target.generate(ids, **kw).tolist()


def test_bf16_checkpoint_follows_the_target_dtype(tmp_path):
    """Shipped drafts are stored in bfloat16; attached to a float32 target they run in float32, losslessly."""
    target = tiny_target("llama")
    draft = _perturbed_draft(target)
    draft.to(torch.bfloat16).save_pretrained(tmp_path)
    loaded = DSparkDraftModel.from_pretrained(tmp_path)
    assert loaded.dtype == torch.bfloat16  # stored precision kept until attached
    loaded.attach(target)
    assert loaded.dtype == torch.float32
    ref = draft.to(torch.float32).state_dict()  # bf16 -> fp32 is exact, so the weights are the stored ones
    assert all(torch.equal(ref[k], v) for k, v in loaded.state_dict().items())
    ids = torch.tensor([[5, 6, 7, 8]])
    kw = dict(max_new_tokens=12, do_sample=False)
    assert target.generate(ids, assistant_model=loaded, **kw).tolist() == target.generate(ids, **kw).tolist()


def _saved(tmp_path):
    target = tiny_target("llama")
    DSparkDraftModel.from_target(target, block_size=4, head_rank=8).save_pretrained(tmp_path)
    return load_file(tmp_path / "model.safetensors")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda sd: sd.pop("fc.weight"), r"missing tensors \['fc.weight'\]"),
        (lambda sd: sd.update(extra=torch.zeros(2)), r"unexpected tensors \['extra'\]"),
        (lambda sd: sd.update({"norm.weight": torch.ones(5)}), r"mis-shaped tensors .*norm.weight \(checkpoint \(5,\)"),
    ],
    ids=["missing", "extra", "mis-shaped"],
)
def test_malformed_checkpoint_is_refused_by_name(tmp_path, edit, message):
    sd = _saved(tmp_path)
    edit(sd)
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        DSparkDraftModel.from_pretrained(tmp_path)


def test_malformed_config_is_refused(tmp_path):
    _saved(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["head_type"] = "transformer"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="head_type must be one of"):
        DSparkDraftModel.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(head_type="lstm"), "head_type must be one of"),
        (dict(block_size=0), "block_size must be >= 1"),
        (dict(target_layer_ids=[0, 9], target_num_layers=4), r"target_layer_ids \[0, 9\] out of range"),
        (dict(num_attention_heads=4, num_key_value_heads=3), "must be a multiple of"),
        (dict(sts_temperatures=[1.0, 1.0], block_size=3), "sts_temperatures has 2 entries"),
        (dict(mask_token_id=500, target_vocab_size=96), "mask_token_id 500 outside"),
    ],
)
def test_config_validation(fields, message):
    with pytest.raises(ValueError, match=message):
        DSparkConfig(**fields)


@pytest.mark.parametrize(
    ("other", "message"),
    [
        (dict(hidden_size=48), "hidden_size: draft expects 32, target has 48"),
        (dict(vocab_size=100), "vocab_size: draft expects 96, target has 100"),
        (dict(layers=5), "num_hidden_layers: draft expects 4, target has 5"),
    ],
)
def test_draft_for_another_target_is_refused(other, message):
    draft = DSparkDraftModel.from_target(tiny_target("llama"), block_size=4, head_rank=8)
    wrong = tiny_target("llama", **other)
    with pytest.raises(ValueError, match=message):
        wrong.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, assistant_model=draft)
    with pytest.raises(ValueError, match="built for another target"):
        draft.attach(wrong)


def test_other_architecture_is_refused():
    draft = DSparkDraftModel.from_target(tiny_target("llama"), block_size=4, head_rank=8)
    with pytest.raises(ValueError, match="model_type: draft expects llama, target has qwen3"):
        tiny_target("qwen3").generate(torch.tensor([[5, 6]]), max_new_tokens=3, assistant_model=draft)


def test_batch_with_streamer_or_scores_is_refused():
    from transformers.generation.streamers import BaseStreamer

    class Recorder(BaseStreamer):
        def put(self, value):
            pass

        def end(self):
            pass

    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    batch = torch.tensor([[5, 6, 7], [7, 8, 9]])
    with pytest.raises(ValueError, match="streamers need batch size 1"):
        target.generate(batch, max_new_tokens=4, assistant_model=draft, streamer=Recorder())
    with pytest.raises(ValueError, match="output_scores/output_logits with DSpark need batch size 1"):
        target.generate(
            batch, max_new_tokens=4, assistant_model=draft, return_dict_in_generate=True, output_scores=True
        )


def test_verify_mode_is_validated():
    with pytest.raises(ValueError, match="verify_mode must be one of"):
        DSparkConfig(verify_mode="greedy")
    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8, confidence_head=False)
    draft.decoding.verify_mode = "scheduled"
    with pytest.raises(ValueError, match="needs a confidence head"):
        target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, assistant_model=draft)


def test_num_return_sequences_is_refused():
    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    with pytest.raises(ValueError, match="num_return_sequences has to be 1"):
        target.generate(
            torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=True, num_return_sequences=2, assistant_model=draft
        )


def test_beam_search_is_refused():
    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    with pytest.raises(ValueError, match="beam search"):
        target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, num_beams=2, assistant_model=draft)


def test_unattached_draft_says_so():
    draft = DSparkDraftModel(DSparkConfig(target_vocab_size=96, hidden_size=32, head_rank=8))
    with pytest.raises(RuntimeError, match="not attached to a target"):
        draft.embed_block(torch.tensor([1]))


@pytest.mark.parametrize("head", ["markov", "gated", "rnn"])
def test_head_step_equals_teacher_forced(head):
    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=5, head_type=head, head_rank=8)
    with torch.no_grad():
        draft.sequential_head.markov_w2.weight.normal_()
    prev, h = torch.randint(0, 96, (3, 5)), torch.randn(3, 5, 32)
    bias_tf, feat_tf = draft.sequential_head.teacher_forced(prev, h)
    state = None
    for k in range(5):
        bias, feat, state = draft.sequential_head.step(prev[:, k], h[:, k], state)
        torch.testing.assert_close(bias, bias_tf[:, k])
        torch.testing.assert_close(feat, feat_tf[:, k])


def test_markov_bias_depends_only_on_previous_token():
    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="markov", head_rank=8)
    head = draft.sequential_head
    with torch.no_grad():
        head.markov_w2.weight.normal_()
    bias, _, _ = head.step(torch.tensor([3, 3, 4]), torch.randn(3, 32))
    torch.testing.assert_close(bias[0], bias[1])
    torch.testing.assert_close(bias[0], head.markov_w1.weight[3] @ head.markov_w2.weight.T)
    assert not torch.allclose(bias[0], bias[2])


def test_soft_acceptance_label_is_one_minus_half_l1():
    p, q = torch.softmax(torch.randn(4, 10), -1), torch.softmax(torch.randn(4, 10), -1)
    torch.testing.assert_close(soft_acceptance_label(p, q), 1 - 0.5 * (p - q).abs().sum(-1))
    torch.testing.assert_close(soft_acceptance_label(p, p), torch.ones(4))


def test_confidences_are_recorded_per_round():
    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=10, do_sample=False, assistant_model=draft)
    assert len(draft.stats.confidences) == draft.stats.rounds
    assert all(len(c) == p for c, p in zip(draft.stats.confidences, draft.stats.proposed, strict=True))
    assert all(0 < x < 1 for c in draft.stats.confidences for x in c)


def test_draft_vocabulary_is_lossless_saved_and_validated(tmp_path):
    target = tiny_target("llama")
    draft = _perturbed_draft(target)
    ids = torch.tensor([[5, 6, 7, 8]])
    kw = dict(max_new_tokens=24, do_sample=False)
    ref = target.generate(ids, **kw)
    full = target.generate(ids, assistant_model=draft, **kw)
    vocab = torch.tensor(sorted(set(range(0, 96, 2)) | set(ref[0].tolist()[:10])))
    draft.set_draft_vocab(vocab.flip(0))  # any order; stored sorted
    assert torch.equal(draft.draft_vocab, vocab) and draft.config.draft_vocab_size == len(vocab)
    # logits outside the subset are -inf, inside equal to the full head's
    h = torch.randn(2, 3, draft.config.hidden_size)
    sub, whole = draft.draft_logits(h), draft.lm_head(h)
    outside = torch.ones(96, dtype=torch.bool)
    outside[vocab] = False
    assert sub[..., outside].eq(float("-inf")).all()
    torch.testing.assert_close(sub[..., vocab], whole[..., vocab])
    assert target.generate(ids, assistant_model=draft, **kw).tolist() == ref.tolist() == full.tolist()
    # saved with the draft (a buffer in the safetensors file) and restored exactly
    draft.save_pretrained(tmp_path)
    loaded = DSparkDraftModel.from_pretrained(tmp_path)
    assert torch.equal(loaded.draft_vocab, vocab) and loaded.config.draft_vocab_size == len(vocab)
    assert target.generate(ids, assistant_model=loaded, **kw).tolist() == ref.tolist()
    # training still sees the whole vocabulary (no -inf logits for labels outside the subset)
    from hf_dspark.training.features import target_outputs
    from hf_dspark.training.losses import block_predictions

    seq = ref[:, :20]
    valid = torch.ones_like(seq, dtype=torch.bool)
    feats, final = target_outputs(target, loaded.config.target_layer_ids, seq, valid)
    assert block_predictions(loaded, feats, seq, valid, torch.tensor([[4, 9]]), final).logits.isfinite().all()
    # back to the whole vocabulary
    loaded.set_draft_vocab(None)
    assert loaded.draft_vocab is None and loaded.config.draft_vocab_size is None
    assert "draft_vocab" not in loaded.state_dict()
    assert target.generate(ids, assistant_model=loaded, **kw).tolist() == ref.tolist()


@pytest.mark.parametrize(
    ("ids", "message"),
    [([], "at least one token id"), ([3, 3], "distinct"), ([5, 96], r"lie in \[0, 96\)"), ([-1], r"lie in \[0")],
)
def test_draft_vocabulary_errors(ids, message):
    draft = DSparkDraftModel.from_target(tiny_target("llama"), block_size=4, head_rank=8)
    with pytest.raises(ValueError, match=message):
        draft.set_draft_vocab(ids)
    with pytest.raises(ValueError, match="draft_vocab_size must be between 1 and the vocabulary size 96"):
        DSparkConfig(target_vocab_size=96, draft_vocab_size=97)


@pytest.mark.parametrize("head", ["markov", "gated", "rnn"])
def test_a_head_storing_draft_vocabulary_rows_proposes_the_same_and_saves_smaller(tmp_path, head):
    """head_vocab='draft' keeps W2's rows for the draft vocabulary only: greedy and sampled proposals, draft
    probabilities and confidences equal the whole-vocabulary W2's; the checkpoint holds (V - Vd)·r fewer values;
    changing the vocabulary keeps the shared rows and 'full' brings the dropped ones back as zeros."""
    from transformers.generation import LogitsProcessorList, TemperatureLogitsWarper

    from hf_dspark.decoding.drafting import DraftContext, draft_block

    target = tiny_target("llama", dtype=torch.float64)
    full = _perturbed_draft(target, head_type=head).double()
    vocab = torch.arange(2, 96, 3)
    full.set_draft_vocab(vocab)
    full.save_pretrained(tmp_path / "full")
    DSparkDraftModel.from_pretrained(tmp_path / "full").set_head_vocab("draft").save_pretrained(tmp_path / "compact")
    compact = DSparkDraftModel.from_pretrained(tmp_path / "compact").attach(target)
    w2 = "sequential_head.markov_w2.weight"
    assert compact.config.head_vocab == "draft" and compact.state_dict()[w2].shape == (len(vocab), 8)
    assert torch.equal(compact.state_dict()[w2], full.state_dict()[w2][vocab])
    saved = [(tmp_path / name / "model.safetensors").stat().st_size for name in ("full", "compact")]
    assert saved[0] - saved[1] == (96 - len(vocab)) * 8 * 8  # float64 rows of the 64 tokens outside

    R, history = 2, [torch.tensor([7, 8, 9, 10, 11, 12, 13]), torch.tensor([1, 2, 3, 4, 5, 6, 40])]
    feats = torch.randn(R, 6, len(full.config.target_layer_ids) * 32, dtype=torch.float64)

    def propose(draft, processors, sample):
        ctx = DraftContext.empty(draft, R, torch.device("cpu"))
        ctx.extend(draft.fuse_context(feats), torch.arange(6).expand(R, 6), torch.ones(R, 6, dtype=torch.bool))
        torch.manual_seed(0)
        return draft_block(draft, ctx, history, torch.full((R,), 6), 4, processors, sample)

    warm = LogitsProcessorList([TemperatureLogitsWarper(0.7)])
    for processors, sample in ((LogitsProcessorList(), False), (warm, False), (warm, True)):
        a, b = propose(full, processors, sample), propose(compact, processors, sample)
        assert a.tokens.tolist() == b.tokens.tolist()
        torch.testing.assert_close(a.confidences, b.confidences, rtol=0, atol=1e-12)
        if sample:
            torch.testing.assert_close(a.probs, b.probs, rtol=0, atol=1e-12)
    ids = torch.tensor([[5, 6, 7, 8]])
    kw = dict(max_new_tokens=20, do_sample=False)
    assert target.generate(ids, assistant_model=compact, **kw).tolist() == target.generate(ids, **kw).tolist()

    # another vocabulary: shared rows kept, new ones zero; the whole vocabulary: dropped rows back as zeros
    kept = compact.state_dict()[w2].clone()
    compact.set_draft_vocab(torch.arange(0, 96, 2))
    assert compact.config.head_vocab == "draft" and compact.state_dict()[w2].shape == (48, 8)
    shared = torch.tensor([t for t in range(0, 96, 2) if t % 3 == 2])
    assert torch.equal(compact.state_dict()[w2][shared // 2], kept[(shared - 2) // 3])
    assert not compact.state_dict()[w2][torch.tensor([t // 2 for t in range(0, 96, 2) if t % 3 != 2])].any()
    compact.set_draft_vocab(None)
    assert compact.config.head_vocab == "full" and compact.state_dict()[w2].shape == (96, 8)
    assert torch.equal(compact.state_dict()[w2][shared], kept[(shared - 2) // 3])
    assert compact.state_dict()[w2].count_nonzero(dim=1).gt(0).sum() == len(shared)


def test_head_vocabulary_errors():
    draft = DSparkDraftModel.from_target(tiny_target("llama"), block_size=4, head_rank=8)
    with pytest.raises(ValueError, match=r"set_head_vocab\('draft'\) needs a draft vocabulary"):
        draft.set_head_vocab("draft")
    with pytest.raises(ValueError, match="set_head_vocab takes 'full' or 'draft', got 'target'"):
        draft.set_head_vocab("target")
    with pytest.raises(ValueError, match="head_vocab='draft' stores W2's rows for a draft vocabulary"):
        DSparkConfig(target_vocab_size=96, head_vocab="draft")
    with pytest.raises(ValueError, match="head_vocab must be one of"):
        DSparkConfig(target_vocab_size=96, head_vocab="half")


def test_frequent_tokens_by_hand():
    from hf_dspark.training.data import frequent_tokens

    rows = [{"response_ids": [5, 5, 7, 9]}, {"response_ids": [7, 5, 2, 9, 9]}]
    # counts: 5 -> 3, 9 -> 3, 7 -> 2, 2 -> 1; ties broken by the lower id
    assert frequent_tokens(rows, 2).tolist() == [5, 9]
    assert frequent_tokens(rows, 3, always=[0]).tolist() == [0, 5, 7, 9]
