"""DSpark sampling is lossless: the first generated tokens follow the target's exact (processed) distribution.

The exact distribution of the first 3 new tokens is enumerated from the target; DSpark samples are compared with
a chi-square goodness-of-fit test at α = 1e-3 (bins with expected count < 5 are pooled), i.e. a correct
implementation fails each check with probability 0.1%. Seeds are fixed, so a run is reproducible.
"""

import pytest
import torch
from helpers import ALPHA, CASES, VOCAB, chi_square_pvalue, exact_distribution, processors, sample_counts

import hf_dspark
import hf_dspark.decoding.proposers
from hf_dspark import DSparkDraftModel
from hf_dspark.testing import tiny_target


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)  # tiny models: thread hand-offs cost more than the math
    return tiny_target("llama", vocab_size=VOCAB, dtype=torch.float64, seed=3, tie_word_embeddings=False)


@pytest.mark.parametrize(
    ("head", "case"),
    [
        ("none", "top-k-top-p"),
        ("markov", "top-k-top-p"),
        ("gated", "top-k-top-p"),
        ("rnn", "top-k-top-p"),
        ("markov", "temperature"),
    ],
)
def test_sampling_matches_target_distribution(target, head, case):
    """Every head type with temperature 1.3 + top-k + top-p; the Markov head also with a temperature alone."""
    kw = CASES[case]
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type=head, head_rank=4)
    draft.decoding.verify_mode = "fixed"  # verify all γ: the most rejection sampling per sample
    torch.manual_seed(1)
    with torch.no_grad():  # make the head matter: random (not neutral) Markov weights
        if draft.sequential_head is not None:
            draft.sequential_head.markov_w2.weight.normal_(0, 2.0)
    probs = exact_distribution(target, processors(kw["temperature"], kw["top_k"], kw["top_p"]))
    counts = sample_counts(target, draft, kw)
    assert chi_square_pvalue(counts, probs) > ALPHA
    # the draft really was exercised: some proposals rejected, some accepted
    assert 0 < draft.seen["accepted"] < draft.seen["proposed"]


@pytest.mark.parametrize("mode", ["scheduled", "async", "threshold"])
def test_sampling_is_lossless_with_confidence_scheduled_verification(target, mode):
    from hf_dspark.scheduling.policy import SPSProfile

    kw = CASES["top-k-top-p"]
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="markov", head_rank=4)
    torch.manual_seed(2)
    with torch.no_grad():
        draft.sequential_head.markov_w2.weight.normal_(0, 2.0)
        draft.confidence.confidence_head.weight.normal_(0, 1.0)
    draft.decoding.verify_mode = mode
    draft.sps_profile = SPSProfile.from_callable(lambda B: 1.0 / (1.0 + 0.3 * B))
    probs = exact_distribution(target, processors(kw["temperature"], kw["top_k"], kw["top_p"]))
    counts = sample_counts(target, draft, kw)
    assert chi_square_pvalue(counts, probs) > ALPHA
    assert len(draft.seen["lengths"]) > 1  # the verify length really varied with the confidences
    assert 0 < draft.seen["accepted"] < draft.seen["proposed"]


def test_broken_acceptance_rule_is_detected(target, monkeypatch):
    """Accepting every draft token (skipping the p/q test) yields the draft's distribution, and the test sees it."""

    def accept_all(draft_tokens, draft_probs, target_probs, generator=None):
        n = draft_tokens.shape[0]
        return n, torch.multinomial(target_probs[n], 1)[0]

    monkeypatch.setattr(hf_dspark.decoding.verify, "rejection_sample", accept_all)
    kw = CASES["temperature"]
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="markov", head_rank=4)
    draft.decoding.verify_mode = "fixed"
    probs = exact_distribution(target, processors(kw["temperature"]))
    counts = sample_counts(target, draft, kw, n=600)
    assert chi_square_pvalue(counts, probs) < 1e-6


def test_sampling_is_lossless_with_a_draft_vocabulary(target, monkeypatch):
    """A draft restricted to tokens {0, 2, 3} never proposes another token, and the samples still follow the
    target's distribution (which puts mass on all six tokens)."""
    kw = CASES["top-k-top-p"]
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="markov", head_rank=4)
    draft.decoding.verify_mode = "fixed"
    torch.manual_seed(5)
    with torch.no_grad():
        draft.sequential_head.markov_w2.weight.normal_(0, 2.0)
    draft.set_draft_vocab([3, 0, 2])
    proposed = set()
    original = hf_dspark.decoding.proposers.draft_block

    def spy(*args, **kwargs):
        proposal = original(*args, **kwargs)
        proposed.update(proposal.tokens.flatten().tolist())
        if proposal.tokens.numel():
            assert proposal.probs[..., [1, 4, 5]].abs().max() == 0  # q is exactly zero outside the subset
        return proposal

    monkeypatch.setattr(hf_dspark.decoding.proposers, "draft_block", spy)
    probs = exact_distribution(target, processors(kw["temperature"], kw["top_k"], kw["top_p"]))
    counts = sample_counts(target, draft, kw)
    assert proposed <= {0, 2, 3} and len(proposed) > 1
    assert chi_square_pvalue(counts, probs) > ALPHA
    assert {t for k in counts for t in k} - {0, 2, 3}  # the target's own tokens outside the subset appear
    assert 0 < draft.seen["accepted"] < draft.seen["proposed"]
