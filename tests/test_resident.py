"""Target features held on the device (one target forward per sequence) and the wall-clock training loop."""

import random

import pytest
import torch

from hf_dspark import DSparkDraftModel
from hf_dspark.testing import tiny_rows, tiny_target
from hf_dspark.training.features import target_outputs, target_statistics
from hf_dspark.training.losses import DSparkTrainingModule
from hf_dspark.training.resident import ClockTraining, ResidentFeatures, tau_proxy, train_for


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    target = tiny_target("llama", vocab_size=96)
    rows = tiny_rows(target, n=10, new_tokens=20)
    rows[3] = {**rows[3], "response_ids": rows[3]["response_ids"][:5]}  # rows of several lengths
    rows[7] = {**rows[7], "target_wrote": False}
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    return target, rows, draft


def test_features_are_the_targets_own_outputs_row_by_row(setup):
    target, rows, draft = setup
    layers = draft.config.target_layer_ids
    resident = ResidentFeatures.compute(target, layers, rows, max_length=24, batch_tokens=60, buckets=3)
    assert resident.rows == len(rows) and resident.ids.numel() == sum(min(24, len(r["prompt_ids"]) + len(
        r["response_ids"])) for r in rows)  # fmt: skip
    by_length = sorted(rows, key=lambda r: len((r["prompt_ids"] + r["response_ids"])[:24]))
    head = target.get_output_embeddings()
    for k, row in enumerate(by_length):
        ids = (row["prompt_ids"] + row["response_ids"])[:24]
        at, n = int(resident.starts[k]), int(resident.lengths[k])
        assert n == len(ids) and resident.ids[at : at + n].tolist() == ids
        feats, final = target_outputs(target, layers, torch.tensor([ids]), torch.ones(1, n, dtype=torch.bool))
        torch.testing.assert_close(resident.features[at : at + n], feats[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(resident.final[at : at + n], final[0], atol=1e-4, rtol=1e-4)
        lse, top = target_statistics(head, final[0])
        torch.testing.assert_close(resident.logsumexp[at : at + n], lse, atol=1e-4, rtol=1e-4)
        assert torch.equal(resident.argmax[at : at + n], top)
        assert bool(resident.target_wrote[k]) == row.get("target_wrote", True)
    assert [b[1] for b in resident.buckets][-1] == len(rows) and resident.buckets[0][0] == 0


def test_a_sampled_batch_gathers_rows_and_draws_anchors_as_make_batch(setup):
    target, rows, draft = setup
    resident = ResidentFeatures.compute(target, draft.config.target_layer_ids, rows, max_length=24, buckets=3)
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(40):
        batch = resident.sample(3, 16, rng, gen)
        B, L = batch.input_ids.shape
        assert batch.anchors.shape == (3, 16) and batch.features.shape == (B, L, resident.features.shape[1])
        for b in range(B):
            n = int(batch.valid[b].sum())
            row = next(k for k in range(resident.rows) if int(resident.lengths[k]) == n and torch.equal(
                resident.ids[resident.starts[k] : resident.starts[k] + n], batch.input_ids[b, :n]))  # fmt: skip
            seen.add(row)
            at = int(resident.starts[row])
            assert torch.equal(batch.features[b, :n], resident.features[at : at + n])
            assert torch.equal(batch.stats[1][b, :n], resident.argmax[at : at + n])
            assert not batch.valid[b, n:].any() and (batch.input_ids[b, n:] == 0).all()
            first = int(resident.first_anchor[row])
            assert int(batch.anchors[b].min()) >= first and int(batch.anchors[b].max()) < n - 1
    assert seen == set(range(resident.rows))  # every row is drawn


def test_sampling_and_a_training_step_read_nothing_back_from_the_device(setup):
    """A step launches work only: no .item()/.tolist() (``_local_scalar_dense``), no data-dependent shapes
    (``nonzero``), and the draft-vocabulary check (``torch.equal``) runs once per run, not once per step."""
    target, rows, draft = setup
    resident = ResidentFeatures.compute(target, draft.config.target_layer_ids, rows, max_length=24)
    trained = DSparkDraftModel.from_target(target, block_size=4, head_rank=8).set_draft_vocab(list(range(0, 96, 2)))
    trained.set_head_vocab("draft")
    module = DSparkTrainingModule(trained, vocab=trained.draft_vocab.clone())
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    resident.sample(2, 8, rng, gen).losses(module)["loss"].backward()  # the once-per-run check
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            resident.sample(2, 8, rng, gen).losses(module)["loss"].backward()
    names = [e.name for e in prof.events()]
    assert names.count("aten::_local_scalar_dense") == 0 and names.count("aten::nonzero") == 0
    assert names.count("aten::equal") == 0


def test_the_learning_rate_follows_the_clock():
    cfg = ClockTraining(lr=1.0, warmup=0.1, min_lr_ratio=0.1)
    assert cfg.lr_factor(0.05) == pytest.approx(0.5) and cfg.lr_factor(0.1) == pytest.approx(1.0)
    assert cfg.lr_factor(0.55) == pytest.approx(0.55) and cfg.lr_factor(1.0) == pytest.approx(0.1)
    assert cfg.lr_factor(2.0) == pytest.approx(0.1)  # past the budget: the floor
    assert tau_proxy([0.5, 0.5]) == pytest.approx(1.75) and tau_proxy([]) == 1.0


def test_train_for_stops_at_its_deadline_and_keeps_the_best_weights(setup, monkeypatch):
    """A simulated clock (each reading 0.5 s later): the run stops once the budget is spent, measures the held-out
    proxy at the start, every milestone and the end, and hands out weights only when they beat the best so far."""
    import hf_dspark.training.resident as resident_module

    target, rows, _ = setup
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    train = ResidentFeatures.compute(target, draft.config.target_layer_ids, rows[:8], max_length=24)
    heldout = ResidentFeatures.compute(target, draft.config.target_layer_ids, rows[8:], max_length=24)
    clock = iter(0.5 * k for k in range(10**6))
    monkeypatch.setattr(resident_module.time, "monotonic", lambda: next(clock))
    kept, logged = [], []
    cfg = ClockTraining(lr=3e-3, batch_size=2, anchors=8, log_every=5, milestone_seconds=5.0, heldout_batches=2)
    result = train_for(draft, train, heldout, cfg, 20.0, None,
                       lambda d, p: kept.append((p, {k: v.clone() for k, v in d.state_dict().items()})),
                       logged.append)  # fmt: skip
    assert 10 <= result.steps <= 20 and result.blocks == result.steps * 2 * 8
    assert kept[0][0] == result.start and logged[0]["event"] == "start"
    proxies = [p["tau_proxy"] for p, _ in kept]
    assert proxies == sorted(proxies) and len(set(proxies)) == len(proxies)  # each kept one beat the one before
    assert result.best == kept[-1][0] and len(result.milestones) >= 3
    assert any("s_per_step" in line for line in logged)
    assert any(not torch.equal(v, kept[0][1][k]) for k, v in draft.state_dict().items() if v.is_floating_point())


def test_a_resident_batch_gives_the_losses_of_the_online_path(setup):
    """The same rows and anchors through the trainer's online path (the target's forward on the padded batch, the
    statistics computed at the slots) and through the resident features: the same losses and acceptances."""
    from hf_dspark.training.trainer import text_by_target

    target, rows, draft = setup
    vocab = torch.arange(0, 96, 3)
    module = DSparkTrainingModule(draft, vocab=vocab)
    resident = ResidentFeatures.compute(target, draft.config.target_layer_ids, rows, max_length=24)
    batch = resident.sample(3, 8, random.Random(3), torch.Generator().manual_seed(3))
    feats, final = target_outputs(target, draft.config.target_layer_ids, batch.input_ids, batch.valid)
    online = module(feats, batch.input_ids, batch.valid, batch.anchors, final, None, batch.target_wrote)
    held = batch.losses(module)
    for key in ("loss", "ce", "tv", "conf", "greedy_accept", "accept"):
        torch.testing.assert_close(held[key], online[key], atol=2e-4, rtol=2e-4)
    assert text_by_target(rows, [7]).tolist() == [False]  # the row that says the target did not write it
