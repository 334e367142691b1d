"""Training: losses go down, the frozen target stays frozen, no leakage from the future, exact resume."""

import json
from dataclasses import replace

import pytest
import torch

from hf_dspark import DSparkDraftModel
from hf_dspark.testing import char_tokenizer, tiny_rows, tiny_target
from hf_dspark.training.data import frequent_tokens, load_dataset, read_prompts
from hf_dspark.training.features import FeatureCache, target_outputs
from hf_dspark.training.losses import DSparkTrainingModule, LossWeights, block_attention_mask, block_predictions
from hf_dspark.training.trainer import (
    TrainConfig,
    make_batch,
    parameter_groups,
    saved_vocab,
    text_by_target,
    train,
)


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    target = tiny_target("llama", seed=1)
    return target, tiny_rows(target)


def _batch(target, draft, rows, seed=0, anchors=6):
    cfg = TrainConfig(batch_size=2, anchors=anchors)
    input_ids, valid, anc, _ = make_batch(rows, cfg, torch.Generator().manual_seed(seed))
    feats, final = target_outputs(target, draft.config.target_layer_ids, input_ids, valid)
    return feats, input_ids, valid, anc, final


def test_block_attention_mask_rule():
    mask = block_attention_mask(torch.tensor([[2, 4]]), torch.tensor([[True] * 5 + [False]]), gamma=2)
    assert mask.shape == (1, 4, 6 + 4)
    ctx, own = mask[0, :, :6], mask[0, :, 6:]
    assert ctx[0].tolist() == [True, True, False, False, False, False]  # block at anchor 2 sees positions 0, 1
    assert ctx[2].tolist() == [True, True, True, True, False, False]  # block at anchor 4 sees 0..3
    assert own.tolist() == [[True, True, False, False]] * 2 + [[False, False, True, True]] * 2


@pytest.mark.parametrize("head", ["none", "markov", "gated", "rnn"])
def test_one_step_decreases_each_loss_and_target_gets_no_gradient(setup, head):
    target, rows = setup
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type=head, head_rank=8)
    module = DSparkTrainingModule(draft)
    batch = _batch(target, draft, rows)
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    before = module(*batch)
    before["loss"].backward()
    assert all(p.grad is None for p in target.parameters())
    assert not any(p.requires_grad for p in target.parameters())
    assert all(p.grad is not None for n, p in draft.named_parameters() if "markov_w1" not in n or head != "none")
    opt.step()
    opt.zero_grad()
    after = module(*batch)
    for key in ["ce", "tv"] + (["conf"] if draft.confidence is not None else []):
        assert after[key] < before[key], key


def test_loss_goes_down_over_a_few_dozen_steps(setup, tmp_path):
    target, rows = setup
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    module = DSparkTrainingModule(draft)
    batch = _batch(target, draft, rows, seed=5)
    first = float(module(*batch)["loss"].detach())
    train(
        target,
        draft,
        rows,
        tmp_path,
        TrainConfig(steps=40, lr=3e-3, anchors=6, batch_size=2),
        progress=False,
        log=lambda s: None,
    )
    draft.eval()
    assert float(DSparkTrainingModule(draft)(*batch)["loss"].detach()) < 0.8 * first


@pytest.mark.parametrize("head", ["none", "markov", "rnn"])
def test_training_over_a_draft_vocabulary(setup, head):
    """``vocab=`` trains the draft as it decodes with that draft vocabulary: the columns are the whole-vocabulary
    logits restricted to the subset, CE skips labels outside it, TV counts the target mass outside it as lost,
    and W2's rows outside it get no gradient. With every id as the subset, nothing changes."""
    target, rows = setup
    torch.manual_seed(2)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type=head, head_rank=8)
    batch = _batch(target, draft, rows)
    V = draft.config.target_vocab_size
    full = DSparkTrainingModule(draft)(*batch)
    same = DSparkTrainingModule(draft, vocab=torch.arange(V).flip(0))(*batch)  # order does not matter
    for key in ["loss", "ce", "tv", "accept", "greedy_accept"]:
        torch.testing.assert_close(same[key], full[key], rtol=1e-5, atol=1e-5)

    labels = batch[1][batch[2]].unique()
    vocab = torch.cat([labels[::2], torch.arange(V)[~torch.isin(torch.arange(V), labels)][::3]]).sort().values
    module = DSparkTrainingModule(draft, vocab=vocab)
    out = module(*batch)
    ref = block_predictions(draft, *batch)
    sub = block_predictions(draft, *batch, vocab=vocab)
    torch.testing.assert_close(sub.logits, ref.logits[..., vocab], rtol=1e-5, atol=1e-5)
    t_logp = ref.target_logprobs  # the whole vocabulary
    torch.testing.assert_close(sub.target_logprobs, t_logp[..., vocab])
    column = {int(t): i for i, t in enumerate(vocab)}
    assert sub.labels.tolist() == [[[column.get(int(x), -1) for x in blk] for blk in row] for row in ref.labels]
    assert sub.target_top.tolist() == [[[column.get(int(x), -1) for x in b] for b in r] for r in ref.target_top]
    # by hand: the draft's distribution is zero outside the subset
    p_d = torch.zeros_like(t_logp).index_copy_(-1, vocab, torch.softmax(sub.logits, -1))
    gamma = 4
    w = torch.exp(-torch.arange(gamma) / gamma) * ref.has_label
    tv = ((p_d - t_logp.exp()).abs().sum(-1) * w).sum() / w.sum()
    w_ce = w * (sub.labels >= 0)
    nll = -torch.log(p_d.gather(-1, ref.labels[..., None]).squeeze(-1).clamp_min(1e-30))
    ce = (torch.where(sub.labels >= 0, nll, 0) * w_ce).sum() / w_ce.sum()
    torch.testing.assert_close(out["tv"], tv, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out["ce"], ce, rtol=1e-4, atol=1e-5)
    assert (sub.labels == -1).any() and (sub.labels >= 0).any()  # the subset really cuts some labels

    out["loss"].backward()
    if head != "none":
        grad = draft.sequential_head.markov_w2.weight.grad.abs().sum(-1)
        outside = torch.ones(V, dtype=torch.bool)
        outside[vocab] = False
        assert grad[outside].max() == 0 and grad[vocab].max() > 0
    for bad, why in [([1, 1, 2], "distinct"), ([0, V], "distinct token ids in"), ([], "distinct")]:
        with pytest.raises(ValueError, match=why):
            DSparkTrainingModule(draft, vocab=torch.tensor(bad, dtype=torch.long))


def test_rows_the_target_did_not_write_take_its_distribution_as_the_ce_label(setup):
    """A row with ``target_wrote`` False (reference text) fits CE to the target's distribution at each slot, the KD
    term's formula, instead of the text's next token; rows the target wrote keep the token. Every row True is the
    default; the trainer reads the flag from the rows (absent: True)."""
    target, rows = setup
    torch.manual_seed(3)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    batch = _batch(target, draft, rows)
    weights = LossWeights(ce=1.0, tv=0.0, conf=0.0, kd=1.0)
    module = DSparkTrainingModule(draft, weights)
    default = module(*batch)
    every = module(*batch, None, torch.tensor([True, True]))
    none = module(*batch, None, torch.tensor([False, False]))
    torch.testing.assert_close(every["ce"], default["ce"])
    torch.testing.assert_close(none["ce"], none["kd"])  # the soft label is the distribution KD fits
    assert abs(float((none["ce"] - default["ce"]).detach())) > 1e-3  # and it is not the text's token
    for key in ["tv", "kd", "accept", "greedy_accept"]:  # only CE's label changes
        torch.testing.assert_close(none[key], default[key])

    # one row of each: by hand, one average over both rows' weighted slots
    pred = block_predictions(draft, *batch)
    logp_d = torch.log_softmax(pred.logits, -1)
    w = torch.exp(-torch.arange(4) / 4) * pred.has_label
    token = -logp_d.gather(-1, pred.labels[..., None]).squeeze(-1)
    soft = -(pred.target_logprobs.exp() * logp_d).sum(-1)
    by_hand = ((token[0] * w[0]).sum() + (soft[1] * w[1]).sum()) / w.sum()
    torch.testing.assert_close(module(*batch, None, torch.tensor([True, False]))["ce"], by_hand)

    reference = {**rows[0], "target_wrote": False}
    assert text_by_target([rows[1], reference], [1, 0, 1]).tolist() == [False, True, False]


def test_a_draft_storing_draft_vocabulary_rows_trains_over_that_vocabulary(setup):
    """head_vocab='draft': training over the draft vocabulary computes what the whole-vocabulary W2 computes, its
    W2 gets the gradient of those rows, and any other training vocabulary is refused by name."""
    target, rows = setup
    torch.manual_seed(2)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="markov", head_rank=8)
    with torch.no_grad():
        draft.sequential_head.markov_w2.weight.normal_(0, 1.0)
    batch = _batch(target, draft, rows)
    vocab = torch.arange(1, 96, 2)
    ref = DSparkTrainingModule(draft, vocab=vocab)(*batch)
    ref["loss"].backward()
    ref_grad = draft.sequential_head.markov_w2.weight.grad[vocab].clone()
    draft.zero_grad()
    draft.set_draft_vocab(vocab).set_head_vocab("draft")
    out = DSparkTrainingModule(draft, vocab=vocab)(*batch)
    for key in ["loss", "ce", "tv", "accept", "greedy_accept"]:
        torch.testing.assert_close(out[key], ref[key], rtol=1e-6, atol=1e-6)
    out["loss"].backward()
    torch.testing.assert_close(draft.sequential_head.markov_w2.weight.grad, ref_grad, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match=r"train over that same vocabulary, or call draft\.set_head_vocab"):
        DSparkTrainingModule(draft, vocab=torch.arange(0, 96, 2))(*batch)


def test_block_outputs_do_not_see_tokens_after_the_anchor(setup):
    target, rows = setup
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8).eval()
    feats, input_ids, valid, _, logits = _batch(target, draft, rows)
    anchors = torch.tensor([[8, 12], [10, 14]])
    module = DSparkTrainingModule(draft)
    ref = module(feats, input_ids, valid, anchors, logits)
    # change everything after each row's *first* anchor: target features and tokens beyond position a
    feats2, ids2 = feats.clone(), input_ids.clone()
    for r, a in enumerate(anchors[:, 0].tolist()):
        feats2[r, a:] = torch.randn_like(feats2[r, a:])
        ids2[r, a + 1 :] = torch.randint(3, 96, ids2[r, a + 1 :].shape)

    captured = {}
    original = draft.forward

    def spy(*args, **kw):
        out = original(*args, **kw)
        captured.setdefault("h", []).append(out.hidden_states)
        return out

    draft.forward = spy
    module(feats, input_ids, valid, anchors, logits)
    module(feats2, ids2, valid, anchors, logits)
    h_ref, h_new = captured["h"]
    torch.testing.assert_close(h_ref[:, :4], h_new[:, :4])  # the first block of each row is unchanged
    assert not torch.allclose(h_ref[:, 4:], h_new[:, 4:])  # the later block did see the changes
    assert ref["loss"].isfinite()


def test_resume_gives_identical_parameters(setup, tmp_path):
    target, rows = setup
    cfg = TrainConfig(steps=12, lr=3e-3, anchors=4, batch_size=2, save_every=5, seed=7)

    def fresh():
        torch.manual_seed(0)
        return DSparkDraftModel.from_target(target, block_size=4, head_rank=8)

    straight = train(target, fresh(), rows, tmp_path / "a", cfg, progress=False, log=lambda s: None)
    # interrupted run: stop at step 7 (checkpoints at 5 and 7), then resume to 12 with a freshly built draft
    train(target, fresh(), rows, tmp_path / "b", cfg, progress=False, log=lambda s: None, stop_at=7)
    assert (tmp_path / "b" / "checkpoint-7" / "step.json").is_file()
    assert not (tmp_path / "b" / "final").exists()
    resumed = train(target, fresh(), rows, tmp_path / "b", cfg, progress=False, log=lambda s: None)
    a, b = straight.state_dict(), resumed.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not list((tmp_path / "b").glob(".tmp-*"))


def test_the_decoder_layers_can_train_at_a_scaled_learning_rate(setup, tmp_path):
    """``layers_lr_scale`` puts the draft's decoder layers in their own optimizer group at lr * scale (through
    warmup and decay); everything else trains at lr. Adam moves a parameter by about its lr a step, so after a few
    steps the layers have moved about a hundredth as far as the fusion layer."""
    target, rows = setup
    torch.manual_seed(0)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    cfg = TrainConfig(steps=4, lr=1e-3, layers_lr_scale=0.01, anchors=4, batch_size=2, warmup_ratio=0.0)
    module = DSparkTrainingModule(draft, cfg.loss_weights)
    groups = parameter_groups(module, draft, cfg)
    assert [len(g["params"]) for g in groups] == [
        sum(1 for p in module.parameters() if p.requires_grad) - len(list(draft.layers.parameters())),
        len(list(draft.layers.parameters())),
    ]
    assert groups[1]["lr"] == pytest.approx(1e-5) and "lr" not in groups[0]
    assert len(parameter_groups(module, draft, TrainConfig())) == 1
    with pytest.raises(ValueError, match="layers_lr_scale must be positive"):
        parameter_groups(module, draft, TrainConfig(layers_lr_scale=0.0))

    before = {k: v.clone() for k, v in draft.state_dict().items()}
    trained = train(target, draft, rows, tmp_path, cfg, progress=False, log=lambda s: None).state_dict()
    moved = {k: (trained[k] - before[k]).abs().max().item() for k in before}
    layers = max(v for k, v in moved.items() if k.startswith("layers."))
    assert 0 < layers < cfg.steps * 1e-5 * 3
    assert moved["fc.weight"] > 30 * layers


def test_a_run_resumes_only_at_its_own_layer_learning_rate(setup, tmp_path):
    """The optimizer state holds one group per learning rate, so a checkpoint saved at one ``layers_lr_scale`` is
    refused by name at another (before accelerate's load fails on the group count), and resumes at its own."""
    target, rows = setup
    cfg = TrainConfig(steps=4, lr=3e-3, anchors=4, batch_size=2, save_every=2, layers_lr_scale=0.1)
    quiet = dict(progress=False, log=lambda s: None)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    train(target, draft, rows, tmp_path, cfg, stop_at=2, **quiet)
    assert json.loads((tmp_path / "checkpoint-2" / "step.json").read_text()) == {"step": 2, "layers_lr_scale": 0.1}
    for other in [1.0, 0.5]:
        with pytest.raises(ValueError, match=rf"trained with layers_lr_scale=0.1, not {other}"):
            train(target, draft, rows, tmp_path, replace(cfg, layers_lr_scale=other), **quiet)
    train(target, draft, rows, tmp_path, cfg, **quiet)
    assert (tmp_path / "final" / "model.safetensors").is_file()


def test_milestone_checkpoints_survive_pruning(setup, tmp_path):
    target, rows = setup
    cfg = TrainConfig(steps=7, anchors=2, save_every=1, keep_checkpoints=1, milestone_every=3)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    train(target, draft, rows, tmp_path, cfg, progress=False, log=lambda s: None)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6", "checkpoint-7"]


def test_a_run_keeps_its_draft_vocabulary(setup, tmp_path):
    """The first start given ids writes them to draft_vocab.json; a resume with other ids, or none, is refused by
    name (its checkpoints learned those columns); a whole-vocabulary run may switch to one when resumed."""
    target, rows = setup
    cfg = TrainConfig(steps=4, lr=3e-3, anchors=4, batch_size=2, save_every=2)
    quiet = dict(progress=False, log=lambda s: None)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    vocab = frequent_tokens(rows, 20, always=[0, 1, 2])
    train(target, draft, rows, tmp_path / "a", cfg, stop_at=2, vocab=vocab, **quiet)
    assert draft.draft_vocab is None  # an unfinished run leaves the draft as it was
    assert saved_vocab(tmp_path / "a").tolist() == vocab.tolist()
    for other in [vocab[1:], None]:
        with pytest.raises(ValueError, match=r"draft vocabulary in draft_vocab\.json"):
            train(target, draft, rows, tmp_path / "a", cfg, vocab=other, **quiet)
    final = train(target, draft, rows, tmp_path / "a", cfg, vocab=vocab.flip(0), **quiet)  # same ids, any order
    assert final.draft_vocab.tolist() == vocab.tolist()
    assert DSparkDraftModel.from_pretrained(tmp_path / "a" / "final").config.draft_vocab_size == len(vocab)
    fresh = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    train(target, fresh, rows, tmp_path / "b", cfg, stop_at=2, **quiet)
    assert saved_vocab(tmp_path / "b") is None
    train(target, fresh, rows, tmp_path / "b", cfg, vocab=vocab, **quiet)
    assert saved_vocab(tmp_path / "b").tolist() == vocab.tolist()


def test_read_prompts_refuses_eval_files(tmp_path):
    d = tmp_path / "eval"
    d.mkdir()
    (d / "x.jsonl").write_text('{"turns": ["hi"]}\n')
    with pytest.raises(ValueError, match="eval/ folder"):
        read_prompts(d / "x.jsonl")
    assert read_prompts(d / "x.jsonl", allow_eval=True)[0].messages == [{"role": "user", "content": "hi"}]


def test_read_prompts_formats_and_errors(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"question": "q1"}\n{"messages": [{"role": "user", "content": "m"}]}\n')
    assert [p.messages[0]["content"] for p in read_prompts(tmp_path / "a.jsonl")] == ["q1", "m"]
    (tmp_path / "b.json").write_text('[{"instruction": "do", "input": "x"}]')
    assert read_prompts(tmp_path / "b.json")[0].messages[0]["content"] == "do\n\nx"
    (tmp_path / "c.jsonl").write_text('{"turns": ["ok"]}\n{"turns": \n')
    with pytest.raises(ValueError, match=r"c.jsonl:2: not valid JSON"):
        read_prompts(tmp_path / "c.jsonl")


def test_dataset_with_torn_last_line_loads(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"id": "a", "prompt_ids": [1], "response_ids": [2]}\n{"id": "b", "prompt')
    assert [r["id"] for r in load_dataset(p)] == ["a"]


def test_two_process_training_keeps_ranks_identical(tmp_path):
    """A real 2-process CPU run (accelerate launch, DDP over gloo): both ranks train and end with equal params."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "testing" / "mp_train.py"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        "29518",
        str(script),
        str(tmp_path),
    ]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]
    assert ranks[0]["moved"] > 0  # training really updated the draft
    assert ranks[0]["params"] == ranks[1]["params"]
    # the checkpoint holds both ranks' RNG states, and no process left a half-written folder behind
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoint-4").glob("random_states_*"))
    assert saved == ["random_states_0.pkl", "random_states_1.pkl"]
    assert not list((tmp_path / "run").glob(".tmp-*"))


def test_cli_train_then_calibrate(setup, tmp_path):
    import json

    from hf_dspark.cli import main

    target, rows = setup
    target.save_pretrained(tmp_path / "target")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match="--draft-vocab needs the target's tokenizer"):
        main(
            [
                "train",
                "--target",
                str(tmp_path / "target"),
                "--data",
                str(data),
                "--out",
                str(out),
                "--draft-vocab",
                "30",
                "--steps",
                "1",
            ]
        )
    char_tokenizer().save_pretrained(tmp_path / "target")
    main(
        [
            "train",
            "--draft-vocab",
            "30",
            "--target",
            str(tmp_path / "target"),
            "--data",
            str(data),
            "--out",
            str(out),
            "--steps",
            "6",
            "--layers",
            "1",
            "--rank",
            "8",
            "--block-size",
            "4",
            "--anchors",
            "4",
            "--save-every",
            "3",
            "--layers-lr",
            "0.5",
            "--feature-cache",
            str(tmp_path / "features"),
        ]
    )
    assert (out / "final" / "model.safetensors").is_file() and (out / "checkpoint-6").is_dir()
    assert json.loads((out / "final" / "train_config.json").read_text())["layers_lr_scale"] == 0.5
    assert list((tmp_path / "features").rglob("*.safetensors"))  # the target's features were cached
    # trained over the 30 most frequent answer tokens + the tokenizer's special ids, and shipped with them
    vocab = json.loads((out / "draft_vocab.json").read_text())
    assert vocab == frequent_tokens(rows, 30, always=char_tokenizer().all_special_ids).tolist()
    assert DSparkDraftModel.from_pretrained(out / "final").draft_vocab.tolist() == vocab
    main(
        [
            "calibrate",
            "--target",
            str(tmp_path / "target"),
            "--draft",
            str(out / "final"),
            "--data",
            str(data),
            "--blocks",
            "40",
        ]
    )
    cfg = json.loads((out / "final" / "config.json").read_text())
    assert len(cfg["sts_temperatures"]) == 4 and all(t > 0 for t in cfg["sts_temperatures"])
    report = json.loads((out / "final" / "calibration.json").read_text())
    assert report["blocks"] == 40 and len(report["after"]["ece"]) == 4
    assert (out / "final" / "reliability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # decode calibration changes the temperatures and nothing else in the config
    main(
        [
            "calibrate",
            "--target",
            str(tmp_path / "target"),
            "--draft",
            str(out / "final"),
            "--data",
            str(data),
            "--blocks",
            "30",
            "--source",
            "decode",
            "--max-new-tokens",
            "24",
        ]
    )
    decoded = json.loads((out / "final" / "config.json").read_text())
    assert {k: v for k, v in decoded.items() if k != "sts_temperatures"} == {
        k: v for k, v in cfg.items() if k != "sts_temperatures"
    }
    assert len(decoded["sts_temperatures"]) == 4 and all(t > 0 for t in decoded["sts_temperatures"])
    report = json.loads((out / "final" / "calibration.json").read_text())
    assert report["source"] == "decode" and report["blocks"] == 30 and report["max_new_tokens"] == 24
    # the calibrated draft still loads and decodes losslessly
    draft = DSparkDraftModel.from_pretrained(out / "final")
    ids = torch.tensor([[5, 6, 7, 8]])
    kw = dict(max_new_tokens=10, do_sample=False)
    assert target.generate(ids, assistant_model=draft, **kw).tolist() == target.generate(ids, **kw).tolist()


def test_target_outputs_are_the_hidden_states_of_a_whole_forward(setup):
    """The feature pass skips the target's logits (logits_to_keep); its states are those of a full forward."""
    target, rows = setup
    layer_ids = [0, 1]
    ids = torch.tensor([rows[0]["prompt_ids"] + rows[0]["response_ids"]])
    valid = torch.ones_like(ids, dtype=torch.bool)
    feats, final = target_outputs(target, layer_ids, ids, valid)
    with torch.no_grad():
        full = target(input_ids=ids, output_hidden_states=True)
    assert full.logits.shape[1] == ids.shape[1]
    assert torch.equal(feats, torch.cat([full.hidden_states[i + 1] for i in layer_ids], -1))
    assert torch.equal(final, full.hidden_states[-1])


def test_feature_cache_gives_the_same_training_as_online(setup, tmp_path):
    target, rows = setup
    cfg = TrainConfig(steps=6, lr=3e-3, anchors=4, batch_size=2, seed=3)

    def run(out, cache):
        torch.manual_seed(0)
        draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
        return train(target, draft, rows, out, cfg, progress=False, log=lambda s: None, feature_cache=cache)

    online = run(tmp_path / "a", None)
    cached = run(tmp_path / "b", tmp_path / "features")
    files = list((tmp_path / "features").rglob("*.safetensors"))
    assert 0 < len(files) <= len(rows)
    a, b = online.state_dict(), cached.state_dict()
    for k in a:  # every step reads the fp16-rounded features (the first epoch too): close, not bit-equal
        torch.testing.assert_close(a[k], b[k], rtol=2e-2, atol=5e-3)
    # a corrupt cache file is recomputed, not a crash
    files[0].write_bytes(b"junk")
    fc = FeatureCache(tmp_path / "features", target, online.config.target_layer_ids)
    row = next(r for r in rows if fc._path(r) == files[0])
    feats, final, lse, top = fc.get(row, 1024, torch.device("cpu"))
    n = len(row["prompt_ids"]) + len(row["response_ids"])
    assert feats.shape[0] == n and final.shape[-1] == 32 and lse.shape == top.shape == (n,)


def test_soft_label_over_a_draft_vocabulary_is_the_exact_acceptance_probability(setup):
    """With target mass outside the draft vocabulary, the loss's soft label (1 - ½‖p_d - p_t‖₁ over the whole
    vocabulary, from one pass) equals Σ min(p_d, p_t) over the columns, the acceptance probability."""
    from hf_dspark.model.heads import soft_acceptance_label
    from hf_dspark.training.losses import LossWeights, block_losses

    target, rows = setup
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    vocab = torch.arange(0, draft.config.target_vocab_size, 3)
    pred = block_predictions(draft, *_batch(target, draft, rows), vocab)
    p_t = pred.target_logprobs.exp()
    assert (1 - p_t.sum(-1)).min() > 0.1  # the columns miss a real share of the target's mass
    exact = soft_acceptance_label(pred.logits.softmax(-1), p_t)
    per_pos = (exact * pred.has_label).sum((0, 1)) / pred.has_label.sum((0, 1))
    torch.testing.assert_close(block_losses(pred, LossWeights(), 4.0)["accept"], per_pos)


def test_cached_target_statistics_spare_the_whole_vocabulary_head(setup, tmp_path):
    """The cache's per-position (logsumexp, argmax) give the loss the same target log-probs over the draft
    vocabulary's columns, the same target argmax and the same losses as the whole-vocabulary softmax at every slot;
    a cache file written before the statistics existed is recomputed, not misread."""
    from safetensors.torch import load_file, save_file

    from hf_dspark.training.trainer import batch_target_outputs

    target, rows = setup
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    V = draft.config.target_vocab_size
    vocab = torch.randperm(V, generator=torch.Generator().manual_seed(0))[: V // 2].sort().values
    cfg = TrainConfig(batch_size=2, anchors=6)
    input_ids, valid, anchors, idx = make_batch(rows, cfg, torch.Generator().manual_seed(3))
    cache = FeatureCache(tmp_path, target, draft.config.target_layer_ids)
    feats, final, stats = batch_target_outputs(target, draft, rows, idx, input_ids, valid, cache, cfg)
    lse, top = stats
    logits = target.get_output_embeddings()(final)
    torch.testing.assert_close(lse, logits.logsumexp(-1) * valid)  # zero past each row's end
    assert torch.equal(top[valid], logits.argmax(-1)[valid])

    batch = (feats, input_ids, valid, anchors, final)
    cached = block_predictions(draft, *batch, vocab, stats)
    at_slots = block_predictions(draft, *batch, vocab)
    whole = block_predictions(draft, *batch)
    torch.testing.assert_close(cached.target_logprobs, whole.target_logprobs[..., vocab])
    torch.testing.assert_close(at_slots.target_logprobs, whole.target_logprobs[..., vocab])
    column = torch.full((V,), -1).index_copy_(0, vocab, torch.arange(vocab.numel()))
    assert torch.equal(cached.target_top, column[whole.target_top])
    assert torch.equal(at_slots.target_top, cached.target_top)
    module = DSparkTrainingModule(draft, vocab=vocab)
    for key, value in module(*batch, stats).items():
        torch.testing.assert_close(value, module(*batch)[key], msg=key)

    path = cache._path(rows[idx[0]])
    rewritten = {**rows[idx[0]], "response_ids": rows[idx[0]]["response_ids"][::-1]}
    assert cache._path(rewritten) != path  # same id, other tokens: never the stale features
    old = load_file(path)
    save_file({"features": old["features"], "final": old["final"]}, str(path))  # the layout before statistics
    again = cache.get(rows[idx[0]], cfg.max_length, torch.device("cpu"))
    assert len(again) == 4 and set(load_file(path)) == set(FeatureCache.KEYS)
    torch.testing.assert_close(again[2], old["logsumexp"])


@pytest.mark.parametrize("draft_vocab", [False, True])
@pytest.mark.parametrize("head", ["none", "markov", "rnn"])
def test_training_forward_matches_the_decoding_forward(setup, head, draft_vocab):
    """What training optimises is what decoding runs: the teacher-forced block at anchor a, fed the draft's own
    greedy proposals as the 'true' next tokens, gives the same logits as ``draft_block`` over the cached context
    (over the draft vocabulary, when decoding uses one and training is given the same ids)."""
    from transformers import LogitsProcessorList

    from hf_dspark.decoding.drafting import DraftContext, draft_block, target_features

    target, rows = setup
    torch.manual_seed(4)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type=head, head_rank=8).eval()
    for p in draft.parameters():  # a random but not tiny draft, so that its argmaxes are well separated
        p.data.normal_(0, 0.3)
    if draft_vocab:
        draft.set_draft_vocab(torch.randperm(draft.config.target_vocab_size)[:40])
    ids = torch.tensor([rows[0]["prompt_ids"] + rows[0]["response_ids"]])[:, :20]
    a = 12
    with torch.no_grad():
        hidden = target(input_ids=ids[:, :a], output_hidden_states=True).hidden_states
        context = DraftContext.empty(draft, 1, ids.device)
        fused = draft.fuse_context(target_features(draft, hidden))
        context.extend(fused, torch.arange(a)[None], torch.ones(1, a, dtype=torch.bool))
        proposal = draft_block(draft, context, [ids[0, : a + 1]], torch.tensor([a]), 4, LogitsProcessorList(), False)
        seq = torch.cat([ids[:, : a + 1], proposal.tokens], dim=1)  # the anchor x_a, then the draft's own tokens
        valid = torch.ones_like(seq, dtype=torch.bool)
        feats, final = target_outputs(target, draft.config.target_layer_ids, seq, valid)
        pred = block_predictions(draft, feats, seq, valid, torch.tensor([[a]]), final, draft.draft_vocab)
    columns = pred.logits.argmax(-1)[0, 0]
    tokens = draft.draft_vocab[columns] if draft_vocab else columns
    assert tokens.tolist() == proposal.tokens[0].tolist()
    # and the confidence the scheduler sees is the one the confidence loss trains
    torch.testing.assert_close(torch.sigmoid(pred.confidence_logits[0, 0]).double(), proposal.confidences[0])


def test_cli_calibrate_from_prompt_files(setup, tmp_path):
    """`calibrate --prompts FILE --source decode`: prompts as `prepare` reads them, chat template applied; the
    options that cannot work together are refused by name."""
    import json

    from hf_dspark.cli import main
    from hf_dspark.training.calibrate import calibrate_draft

    target, _ = setup
    target.save_pretrained(tmp_path / "target")
    char_tokenizer().save_pretrained(tmp_path / "target")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    draft.save_pretrained(tmp_path / "draft")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"question {i}: what is {i} + {i}?"]}) + "\n" for i in range(5)))
    base = ["calibrate", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft")]
    main(
        [
            *base,
            "--prompts",
            str(prompts),
            "--limit",
            "3",
            "--source",
            "decode",
            "--max-new-tokens",
            "20",
            "--blocks",
            "15",
        ]
    )
    report = json.loads((tmp_path / "draft" / "calibration.json").read_text())
    assert report["source"] == "decode" and report["blocks"] == 15
    assert len(json.loads((tmp_path / "draft" / "config.json").read_text())["sts_temperatures"]) == 4
    with pytest.raises(SystemExit, match="exactly one of --data"):
        main([*base, "--source", "decode"])
    with pytest.raises(SystemExit, match="no answers to teacher-force"):
        main([*base, "--prompts", str(prompts)])
    with pytest.raises(ValueError, match="2 of 2 have none"):
        calibrate_draft(target, tmp_path / "draft", [{"id": "a"}, {"id": "b"}], source="decode")


def _logit_gradient(pred, weights):
    """Backpropagate ``block_losses(pred, weights)`` (decay 4) to fresh leaf draft logits: (those logits with their
    gradient, the losses, the position weights w [R, A, γ])."""
    from hf_dspark.training.losses import block_losses

    pred.confidence_logits = pred.confidence_logits.detach()  # the draft's graph is not under test
    logits = pred.logits.detach().clone().requires_grad_(True)
    pred.logits = logits
    out = block_losses(pred, weights, 4.0)
    out["loss"].backward()
    w = torch.exp(-torch.arange(logits.shape[2]).float() / 4.0) * pred.has_label
    return logits, out, w


def test_distillation_term_pulls_the_draft_to_the_targets_distribution(setup):
    """KD = -Σ p_t log p_d per slot, weighted like TV: its gradient w.r.t. a slot's draft logits is
    (p_d - p_t)·w/Σw, zero where the draft already equals the target; with kd = 0 the loss has no KD term."""
    from hf_dspark.training.losses import LossWeights, block_losses

    target, rows = setup
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    pred = block_predictions(draft, *_batch(target, draft, rows))
    assert "kd" not in block_losses(pred, LossWeights(), 4.0)

    logits, _, w = _logit_gradient(pred, LossWeights(ce=0.0, tv=0.0, conf=0.0, kd=1.0))
    p_t = pred.target_logprobs.exp()
    expected = (logits.detach().softmax(-1) - p_t) * (w / w.sum())[..., None]
    torch.testing.assert_close(logits.grad, expected, atol=1e-7, rtol=1e-4)

    pred.logits = pred.target_logprobs.clone()  # a draft that is the target: the gradient vanishes
    pred.logits.requires_grad_(True)
    block_losses(pred, LossWeights(ce=0.0, tv=0.0, conf=0.0, kd=1.0), 4.0)["loss"].backward()
    assert pred.logits.grad.abs().max() < 1e-6


def test_argmax_term_is_ce_on_the_targets_most_likely_token(setup):
    """argmax = mean over labelled slots (position-weighted) of -log p_d(argmax p_t): its gradient w.r.t. a slot's
    draft logits is (p_d - onehot(argmax p_t))·w/Σw; off by default."""
    from hf_dspark.training.losses import LossWeights, block_losses

    target, rows = setup
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    pred = block_predictions(draft, *_batch(target, draft, rows))
    assert "argmax" not in block_losses(pred, LossWeights(), 4.0)
    torch.testing.assert_close(pred.target_top, pred.target_logprobs.argmax(-1))  # the whole vocabulary here

    logits, out, w = _logit_gradient(pred, LossWeights(ce=0.0, tv=0.0, conf=0.0, argmax=1.0))
    onehot = torch.nn.functional.one_hot(pred.target_top, logits.shape[-1]).float()
    expected = (logits.detach().softmax(-1) - onehot) * (w / w.sum())[..., None]
    torch.testing.assert_close(logits.grad, expected, atol=1e-7, rtol=1e-4)
    nll = -logits.detach().log_softmax(-1).gather(-1, pred.target_top[..., None]).squeeze(-1)
    torch.testing.assert_close(out["argmax"], (nll * w).sum() / w.sum())
