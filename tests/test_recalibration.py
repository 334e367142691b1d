"""Per-call recalibration of the confidence head (hf_dspark/scheduling/recalibration.py) and its use by the
scheduler."""

import pytest
import torch

from hf_dspark import DSparkDraftModel, dspark_generate
from hf_dspark.decoding import costs
from hf_dspark.scheduling.modes import choose_lengths
from hf_dspark.scheduling.policy import ColumnPlan, SPSProfile, drafting_pays
from hf_dspark.scheduling.recalibration import AcceptanceRecalibration
from hf_dspark.testing import tiny_target

# a float32 CPU's shape: one token is cheap, 2..9 tokens cost about 1.4-1.8 plain steps (SmolLM2, 2 cores)
CPU_PROFILE = SPSProfile.from_table({1: 15.8, 2: 11.0, 3: 9.65, 4: 9.0, 5: 9.0, 6: 9.0, 7: 9.0, 8: 9.0, 9: 8.9})


def test_without_observations_the_head_is_unchanged():
    recal = AcceptanceRecalibration(4)
    conf = torch.tensor([[0.0, 0.3, 0.999, 1.0], [0.5, 0.25, 0.1, 0.7]], dtype=torch.float64)
    assert recal.shifts == [0.0] * 4
    assert torch.equal(recal.apply(conf), conf)
    assert torch.equal(recal.apply(conf[:, 1], start=1), conf[:, 1])


def test_an_easy_call_raises_confidences_and_a_hard_one_lowers_them():
    easy, hard = AcceptanceRecalibration(4), AcceptanceRecalibration(4)
    for _ in range(20):
        easy.observe([0.5, 0.5, 0.5, 0.5], accepted=4)  # the head says ½, every token is accepted
        hard.observe([0.9, 0.9, 0.9, 0.9], accepted=0)  # the head says 0.9, the first token is rejected
    flat = torch.full((1, 4), 0.5, dtype=torch.float64)
    assert (easy.apply(flat) > 0.85).all()
    assert hard.apply(torch.full((1, 4), 0.9, dtype=torch.float64))[0, 0] < 0.2
    # position 1 was observed 20 times; positions 2..4 never (the first token was always rejected): they keep
    # position 1's shift
    assert hard.shifts[0] < -2 and hard.shifts[1:] == [hard.shifts[0]] * 3


def test_observed_rate_is_matched_and_shrunk_toward_the_head():
    recal = AcceptanceRecalibration(1, prior=2.0, decay=1.0)
    recal.observe([0.5], accepted=1)
    once = float(recal.apply(torch.tensor([0.5]), 0))
    assert 0.5 < once < 0.9  # one acceptance: moved, not all the way (prior of 2 at the head's ½): (1 + 1) / 3
    assert once == pytest.approx(2 / 3, abs=1e-9)
    for _ in range(8):
        recal.observe([0.5], accepted=0)
    assert float(recal.apply(torch.tensor([0.5]), 0)) == pytest.approx((1 + 1) / 11, abs=1e-9)


def test_shifts_keep_the_ranking_within_a_position():
    recal = AcceptanceRecalibration(2)
    for _ in range(5):
        recal.observe([0.2, 0.3], accepted=2)
    column = torch.tensor([0.05, 0.3, 0.5, 0.7, 0.95], dtype=torch.float64)
    shifted = recal.apply(column, start=0)
    assert (shifted > column).all() and (shifted.diff() > 0).all()


def test_decay_follows_a_call_that_turns_from_easy_to_hard():
    recal = AcceptanceRecalibration(2, decay=0.8)
    for _ in range(15):
        recal.observe([0.5, 0.5], accepted=2)
    assert recal.shifts[0] > 1
    for _ in range(15):
        recal.observe([0.5, 0.5], accepted=0)
    assert recal.shifts[0] < -1


def test_bad_observations_and_settings_are_refused():
    recal = AcceptanceRecalibration(3)
    with pytest.raises(ValueError, match="3 accepted of 2 verified"):
        recal.observe([0.5, 0.5], accepted=3)
    with pytest.raises(ValueError, match=r"0 accepted of 4 verified \(γ = 3\)"):
        recal.observe([0.5] * 4, accepted=0)
    with pytest.raises(ValueError, match="positions must be >= 1"):
        AcceptanceRecalibration(0)
    with pytest.raises(ValueError, match="decay in"):
        AcceptanceRecalibration(2, decay=0.0)
    with pytest.raises(ValueError, match="a threshold applies to the head's own confidences"):
        ColumnPlan([4], threshold=0.5, recalibration=recal)


def test_a_recalibrated_plan_drafts_where_the_head_alone_backs_off():
    """The failure this fixes: confidences flat at ½ on the CPU profile price a drafted round below a plain step
    (back-off); after a few blocks accepted 3-8 deep, the same confidences verify the whole block, and it pays."""
    conf = torch.full((1, 8), 0.5, dtype=torch.float64)
    recal = AcceptanceRecalibration(8)
    for accepted in (3, 8, 4, 5):
        recal.observe([0.5] * 8, accepted=accepted)
    planning = CPU_PROFILE.plus_seconds(0.017)
    head_only = choose_lengths("scheduled", conf, [8], [], planning, 0.5)
    recalibrated = choose_lengths("scheduled", conf, [8], [], planning, 0.5, recalibration=recal)
    assert recalibrated == [8]
    assert not drafting_pays(conf, head_only, 1, CPU_PROFILE, 0.017)
    assert drafting_pays(recal.apply(conf), recalibrated, 1, CPU_PROFILE, 0.017)
    # the column plan (drafting stops where it closes) agrees with the whole-block plan
    plan = ColumnPlan([8], sps=planning, recalibration=recal)
    for k in range(8):
        if not plan.admit(conf[:, k]):
            break
    assert plan.lengths == recalibrated


def test_the_loop_feeds_every_drafted_verify_to_the_recalibration(monkeypatch):
    """End to end: with recalibration, the schedule's recalibration saw exactly the drafted entries of the stats
    (lookups and plain rounds excluded), and the output is plain greedy with it on or off."""

    seen = []
    original = AcceptanceRecalibration.observe
    monkeypatch.setattr(
        AcceptanceRecalibration, "observe", lambda self, c, n: seen.append((len(c), n)) or original(self, c, n)
    )
    monkeypatch.setattr(costs, "draft_seconds", lambda draft, rows, do_sample=False: 0.0)
    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    draft.sps_profile = SPSProfile.from_callable(lambda B: 1.0)  # verifying is free: every round drafts
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    kw = dict(max_new_tokens=30, do_sample=False)
    ref = target.generate(ids, **kw).tolist()
    for on in (True, False):
        seen.clear()
        out = target.generate(ids, custom_generate=dspark_generate, draft=draft, confidence_recalibration=on, **kw)
        assert out.tolist() == ref
        stats = draft.stats
        drafted = [(p, a) for p, a, looked in zip(stats.proposed, stats.accepted, stats.looked_up, strict=True)
                   if p and not looked]  # fmt: skip
        assert seen == (drafted if on else [])
        assert drafted
    assert draft.decoding.resolve(draft.confidence is not None).confidence_recalibration is True  # the default
    with pytest.raises(ValueError, match="confidence_recalibration must be True or False, got 'yes'"):
        target.generate(ids, custom_generate=dspark_generate, draft=draft, confidence_recalibration="yes", **kw)


def test_recalibration_is_saved_with_the_config(tmp_path):
    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4)
    assert draft.decoding.confidence_recalibration is True
    draft.decoding.confidence_recalibration = False
    draft.save_pretrained(tmp_path)
    assert DSparkDraftModel.from_pretrained(tmp_path).decoding.confidence_recalibration is False
    with pytest.raises(ValueError, match="confidence_recalibration must be True or False"):
        DSparkDraftModel.from_target(target, block_size=4, confidence_recalibration=1)
