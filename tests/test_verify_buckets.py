"""Width buckets (``verify_buckets``): every verify block is padded to one of a few widths, the priced modes price
each width at its bucket's cost, and the output is exactly what it is without padding."""

from types import SimpleNamespace

import pytest
import torch

import hf_dspark
from hf_dspark import DSparkDraftModel
from hf_dspark.decoding import chain, tree_rounds, verification
from hf_dspark.decoding.state import DecodeState
from hf_dspark.decoding.tree import TokenTree, VerifiedTree
from hf_dspark.scheduling.policy import SPSProfile, bucket_width, width_buckets
from hf_dspark.settings import DecodingConfig
from hf_dspark.testing import tiny_target


def test_buckets_are_the_powers_of_two_below_the_widest_the_drafts_block_and_the_widest():
    assert width_buckets(1) == (1,)
    assert width_buckets(9) == width_buckets(9, 9) == (1, 2, 4, 8, 9)
    assert width_buckets(8) == (1, 2, 4, 8)
    assert width_buckets(33, 9) == (1, 2, 4, 8, 9, 16, 32, 33)  # a 32-node tree: a whole chain never pads
    assert width_buckets(4, 9) == (1, 2, 4)  # a block wider than the call's widest verify is no bucket
    assert width_buckets(257, 9) == (1, 2, 4, 8, 9, 16, 32, 64, 128, 256, 257)
    assert [bucket_width(w, (1, 2, 4, 8, 9)) for w in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, 9]
    with pytest.raises(ValueError, match=r"a verify of 10 slots is wider than the call's widest bucket \(9\)"):
        bucket_width(10, (1, 2, 4, 8, 9))
    with pytest.raises(ValueError, match="the widest verify must be >= 1 slot, got 0"):
        width_buckets(0)


def test_a_bucketed_profile_prices_each_width_at_its_buckets_cost():
    sps = SPSProfile.from_callable(lambda B: 100.0 / B)
    assert sps.bucketed(None, 2) is sps
    bucketed = sps.bucketed((1, 2, 4, 8, 9), rows=2)
    assert bucketed(2 * 3) == sps(2 * 4) and bucketed(2 * 4) == sps(2 * 4)
    assert bucketed(2 * 5) == bucketed(2 * 8) == sps(2 * 8)
    assert bucketed(5) == sps(2 * 4)  # a packed B of 5 tokens over 2 rows: 3 slots a row, in the 4-slot bucket
    with pytest.raises(ValueError, match="rows must be >= 1"):
        sps.bucketed((1, 2), 0)


class _State:
    """What ``verify_block`` reads of a decode state: one committed token at position 3 after a 3-slot cache."""

    def __init__(self, rows: int):
        self.cache_mask = torch.ones(rows, 3, dtype=torch.long)
        self.tokens = torch.arange(4 * rows).reshape(rows, 4)
        self.lengths = [4] * rows
        self.anchor_positions = torch.tensor([3] * rows)

    size = property(lambda self: len(self.lengths))
    attention_mask = DecodeState.attention_mask


def test_a_verify_block_pads_to_its_bucket_with_masked_slots():
    chain_of_two = VerifiedTree.chain(torch.tensor([5, 7]))
    block = verification.verify_block(_State(1), [chain_of_two], 0, torch.float32, (1, 2, 4, 5))
    assert block.tokens.tolist() == [[3, 5, 7, 0]] and block.valid.tolist() == [[True, True, True, False]]
    assert block.positions.tolist() == [[3, 4, 5, 6]] and block.mask.tolist() == [[1, 1, 1, 1, 1, 1, 0]]
    assert verification.verify_block(_State(1), [chain_of_two], 0, torch.float32).mask is None  # unpadded
    tree = TokenTree()
    tree.add(-1, 5, 0.6, "draft", top=True)
    tree.add(-1, 6, 0.3, "draft")
    branched = VerifiedTree.of(tree, [0, 1])
    block = verification.verify_block(_State(2), [branched, None], 0, torch.float32, (1, 2, 4, 5))
    assert block.tokens.tolist() == [[3, 5, 6, 0], [0, 0, 0, 0]] and block.mask.shape == (2, 1, 4, 7)
    allowed = block.mask[0, 0] == 0  # a padding slot attends to itself alone
    assert allowed[3].tolist() == [False] * 6 + [True] and allowed[2].tolist() == [True] * 4 + [False, True, False]


def _record_widths(monkeypatch) -> list[int]:
    widths, forward = [], verification.target_forward

    def recording(target, tokens, *args):
        widths.append(tokens.shape[1])
        return forward(target, tokens, *args)

    monkeypatch.setattr(verification, "target_forward", recording)
    return widths


CASES = {
    "chain fixed": dict(verify_mode="fixed"),
    "chain scheduled, lookup": dict(verify_mode="scheduled", lookup_max_ngram=2, lookup_max_tokens=6),
    "tree scheduled": dict(verify_mode="scheduled", tree_top_k=3),
    "tree fixed, limit": dict(verify_mode="fixed", tree_top_k=2, verify_limit=5),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rows", [1, 3])
def test_bucketed_verifies_decode_exactly_plain_greedy(monkeypatch, case, rows):
    """Every verify forward is as wide as the bucket of the round's widest row (never wider, never another width),
    and the tokens are plain greedy's, alone and in a batch whose rows finish at different times."""
    from helpers import left_pad

    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="markov", head_rank=8)
    draft.sps_profile = SPSProfile.from_callable(lambda B: 1.0 / (1.0 + 0.02 * B))
    prompts = [[70, 71, 72, 70, 71, 72, 70], [5, 17, 33, 2, 9], [12, 3, 40]][:rows]
    ids, mask = left_pad(prompts)
    kw = dict(attention_mask=mask, max_new_tokens=14, do_sample=False, pad_token_id=0)
    ref = target.generate(ids, **kw)
    widths = _record_widths(monkeypatch)
    settings = CASES[case]
    out = target.generate(ids, custom_generate=hf_dspark.dspark_generate, draft=draft, verify_buckets=True,
                          **settings, **kw)  # fmt: skip
    assert out.tolist() == ref.tolist()
    gamma, stats = draft.config.num_draft_tokens, draft.stats
    if "tree_top_k" in settings:
        widest = 1 + settings.get("verify_limit", gamma * settings["tree_top_k"])
    else:
        widest = 1 + max(gamma, settings.get("lookup_max_tokens", 0))
    buckets = width_buckets(widest, 1 + gamma)
    rounds = widths  # the verify forwards (the prefill runs its own)
    assert len(rounds) == len(stats.verify_rounds)
    assert rounds == [bucket_width(1 + max(lengths), buckets) for lengths in stats.verify_rounds]
    padded = any(w > 1 + max(lengths) for w, lengths in zip(rounds, stats.verify_rounds, strict=True))
    # fixed verifies pad where a row's room runs out; the priced modes fill the bucket they pay for (a width
    # inside a bucket costs the bucket's step), except a lookup continuation, verified whole at its own length
    assert padded or settings["verify_mode"] == "scheduled"


def test_bucketed_sampling_draws_the_same_tokens_as_unpadded(monkeypatch):
    """Padding is never read: a seeded sampling call (fixed verify, so no price moves a choice) draws the same
    tokens with and without buckets, chains and trees (float64, so the wider forward's rounding cannot flip a
    draw)."""
    target = tiny_target("llama").double()
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="markov", head_rank=8).double()
    ids = torch.tensor([[5, 17, 33, 2, 9]])
    for tree_top_k in (1, 3):
        outs = []
        for buckets in (False, True):
            torch.manual_seed(7)
            outs.append(target.generate(ids, custom_generate=hf_dspark.dspark_generate, draft=draft, do_sample=True,
                                        max_new_tokens=16, verify_mode="fixed", tree_top_k=tree_top_k,
                                        verify_buckets=buckets, pad_token_id=0).tolist())  # fmt: skip
        assert outs[0] == outs[1]


def test_priced_schedules_price_each_width_at_its_bucket(monkeypatch):
    """With buckets, a chain's and a tree's schedule price B tokens over the verify's rows at the bucket's width
    (the measured profile may be a larger batch's, after rows left); without, the measured profile as it is."""
    sps = SPSProfile.from_callable(lambda B: 100.0 / B)
    asked = []

    def round_prices(draft, target, rows, do_sample):
        asked.append(rows)
        return sps, 0.01

    monkeypatch.setattr(chain, "round_prices", round_prices)
    call = SimpleNamespace(draft=SimpleNamespace(sps_profile=None), target=None, rules=SimpleNamespace(do_sample=False))
    settings = DecodingConfig(verify_mode="scheduled", verify_buckets=True, cost_recalibration=False)
    rounds = chain.ChainRounds(settings, 8)
    schedule = rounds.schedule
    assert rounds.buckets == schedule.buckets == (1, 2, 4, 8, 9)
    rounds.price(call, 3, 4)
    assert asked == [4] and schedule.sps(3 * 5) == sps(3 * 8) and schedule.sps(3 * 9) == sps(3 * 9)
    assert schedule.planning(3 * 3) == pytest.approx(1 / (1 / sps(3 * 4) + 0.01))
    plain = chain.ChainRounds(DecodingConfig(verify_mode="scheduled", cost_recalibration=False), 8)
    plain.price(call, 3)
    assert plain.buckets is None and plain.schedule.sps is sps
    looked_up = chain.ChainRounds(settings.replace(lookup_max_ngram=2, lookup_max_tokens=20, verify_limit=12), 8)
    assert looked_up.buckets == (1, 2, 4, 8, 9, 13)  # a continuation may be wider than a block, within the limit

    monkeypatch.setattr(tree_rounds, "sps_profile", lambda draft, target, rows, max_width: sps)
    monkeypatch.setattr(tree_rounds, "tree_draft_seconds", lambda draft, top_k, rows: 0.01 * top_k)
    tree_settings = settings.replace(tree_top_k=3)
    trees = tree_rounds.TreeRounds(tree_settings, 8, [], None)
    assert trees.buckets == trees.schedule.buckets == (1, 2, 4, 8, 9, 16, 25)
    trees.price(call, 2)
    assert trees.schedule.sps(2 * 17) == sps(2 * 25) and trees.schedule.sps(2 * 10) == sps(2 * 16)
    assert trees.schedule.sps(2 * 9) == sps(2 * 9)  # the draft's whole block is a bucket of its own
    assert (trees.schedule.drafting, trees.schedule.chain_drafting) == (0.03, 0.01)
