"""STS calibration: lowers ECE on over-confident scores, keeps the ranking; ECE and AUC are right by hand."""

import math

import pytest
import torch

from hf_dspark.model.sts import (
    DEFAULT_GRID,
    calibration_report,
    ece,
    reliability_bins,
    roc_auc,
    sequential_temperature_scaling,
    survival,
)


def test_ece_by_hand():
    p = torch.tensor([0.1, 0.1, 0.9, 0.9])
    y = torch.tensor([0.0, 1.0, 1.0, 1.0])
    # bin of 0.1: mean p 0.1, mean y 0.5 -> 0.4 · ½; bin of 0.9: |0.9 - 1| · ½
    assert ece(p, y, bins=10) == pytest.approx(0.5 * 0.4 + 0.5 * 0.1)


def test_roc_auc_by_hand():
    assert roc_auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == pytest.approx(0.75)
    assert roc_auc(torch.tensor([0.5, 0.5]), torch.tensor([0, 1])) == pytest.approx(0.5)
    assert roc_auc(torch.tensor([0.5, 0.6]), torch.tensor([1, 1])) is None


def synthetic(n=20000, gamma=4, seed=0):
    """True per-position acceptance q = σ(z); the head reports an over-confident logit 3·z."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, gamma, generator=g)
    accepted = (torch.rand(n, gamma, generator=g) < torch.sigmoid(z)).float()
    return 3 * z, accepted


def test_sts_lowers_ece_and_keeps_ranking():
    logits, accepted = synthetic()
    temps = sequential_temperature_scaling(logits, accepted)
    assert all(t > 1 for t in temps)  # over-confident heads get cooled
    report = calibration_report(logits, accepted, temps)
    assert report["after"]["mean_ece"] < 0.5 * report["before"]["mean_ece"]
    assert report["after"]["mean_ece"] < 0.02
    # monotone: per position, the order of calibrated confidences equals the order of raw ones
    raw, cal = torch.sigmoid(logits.double()), torch.sigmoid(logits.double() / torch.tensor(temps).double())
    for k in range(logits.shape[1]):
        ordered = raw[cal[:, k].argsort(), k]
        assert bool((ordered[1:] >= ordered[:-1]).all())
    assert report["after"]["roc_auc"] == report["before"]["roc_auc"]


def test_sts_is_sequential_on_the_prefix_product():
    logits, accepted = synthetic(gamma=3, seed=1)
    temps = sequential_temperature_scaling(logits, accepted)
    a = survival(logits, temps)
    torch.testing.assert_close(a[:, 1], torch.sigmoid(logits[:, 0] / temps[0]) * torch.sigmoid(logits[:, 1] / temps[1]))


def test_sts_shape_error():
    with pytest.raises(ValueError, match=r"must both be \[N, γ\]"):
        sequential_temperature_scaling(torch.zeros(5, 3), torch.zeros(5, 4))
    with pytest.raises(ValueError, match=r"objective must be one of \('ece', 'brier'\), got 'nll'"):
        sequential_temperature_scaling(torch.zeros(5, 3), torch.zeros(5, 3), objective="nll")


def test_ece_flattens_a_shifted_head_where_brier_keeps_its_ranking_useful():
    """A head whose logits are shifted (z - 1.5 for a true acceptance σ(z)) rather than over-confident: ECE is
    minimised by pushing every c_1 to the base rate (the grid's largest temperature), Brier by a finite one."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(20000, 3, generator=g)
    accepted = (torch.rand(20000, 3, generator=g) < torch.sigmoid(z)).float()
    logits = z - 1.5
    by_ece = sequential_temperature_scaling(logits, accepted)
    by_brier = sequential_temperature_scaling(logits, accepted, objective="brier")
    assert by_ece[0] == max(DEFAULT_GRID) and by_brier[0] < 5
    ece_fit, brier_fit = (calibration_report(logits, accepted, t)["after"] for t in (by_ece, by_brier))
    assert brier_fit["brier"][0] < ece_fit["brier"][0] and ece_fit["ece"][0] < brier_fit["ece"][0]


def test_reliability_bins_by_hand():
    probs = torch.tensor([0.05, 0.1, 0.55, 0.6, 0.95])
    outcomes = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0])
    got = reliability_bins(probs, outcomes, bins=2)
    assert [n for _, _, n in got] == [2, 3]
    assert [p for p, _, _ in got] == pytest.approx([0.075, 0.7])
    assert [y for _, y, _ in got] == pytest.approx([0.5, 2 / 3])
    # empty bins are left out
    assert len(reliability_bins(torch.tensor([0.01, 0.02]), torch.tensor([0.0, 1.0]), bins=10)) == 1


def test_confidence_is_float32_in_a_bfloat16_draft():
    """σ(7) = 0.99909 rounds to exactly 1.0 in bfloat16; the scheduler and decode calibration need it below 1."""
    from hf_dspark.model.heads import ConfidenceHead

    c = ConfidenceHead.calibrated(torch.tensor([7.0, -3.0], dtype=torch.bfloat16), None)
    assert c.dtype == torch.float32
    assert torch.sigmoid(torch.tensor(7.0, dtype=torch.bfloat16)).item() == 1.0
    torch.testing.assert_close(c, torch.sigmoid(torch.tensor([7.0, -3.0])))
    c2 = ConfidenceHead.calibrated(torch.tensor([7.0], dtype=torch.bfloat16), 2.0)
    torch.testing.assert_close(c2, torch.sigmoid(torch.tensor([3.5])))


def test_report_survival_by_hand():
    """Two blocks of γ = 2: logits 0 (c = ½) and ln 3 (c = ¾); block 1 accepts both, block 2 rejects slot 1."""
    ln3 = math.log(3.0)
    logits = torch.tensor([[0.0, ln3], [ln3, 0.0]])
    accepted = torch.tensor([[1.0, 1.0], [0.0, 1.0]])  # slot 2 of block 2 was never judged; survival ignores it
    report = calibration_report(logits, accepted, [1.0, 1.0])
    assert report["observed_survival"] == pytest.approx([0.5, 0.5])
    # a_1 = mean(½, ¾); a_2 = mean(½·¾, ¾·½)
    assert report["before"]["predicted_survival"] == pytest.approx([0.625, 0.375])
    assert report["after"]["predicted_survival"] == pytest.approx([0.625, 0.375])
    halved = calibration_report(logits, accepted, [1.0, 1e9])  # T → ∞ pushes c_2 to ½
    assert halved["after"]["predicted_survival"] == pytest.approx([0.625, 0.3125])


def test_the_shipped_calibration_is_a_fit_inside_its_grid_that_improves_the_head():
    """A fit that ran into its grid's bound (all eight ECE temperatures at 31.6, Brier worse after than before) looks
    broken to anyone who opens the checkpoint: the shipped temperatures lie inside the grid, and the fit improves
    both scores it reports on its own blocks."""
    import json

    from hf_dspark.embedded import DRAFT_DIR
    from hf_dspark.model.sts import DEFAULT_GRID

    config = json.loads((DRAFT_DIR / "config.json").read_text())
    report = json.loads((DRAFT_DIR / "calibration.json").read_text())
    temps = config["sts_temperatures"]
    assert temps == report["temperatures"] and len(temps) == config["block_size"]
    assert all(min(DEFAULT_GRID) < t < max(DEFAULT_GRID) for t in temps), temps
    assert report["after"]["mean_brier"] <= report["before"]["mean_brier"]
    assert report["after"]["mean_ece"] <= report["before"]["mean_ece"]
    assert (DRAFT_DIR / "reliability.png").read_bytes()[:4] == b"\x89PNG"
