"""DSpark sampling is lossless: the first generated tokens follow the target's exact (processed) distribution.

The exact distribution of the first 3 new tokens is enumerated from the target; DSpark samples are compared with
a chi-square goodness-of-fit test at α = 1e-3 (bins with expected count < 5 are pooled), i.e. a correct
implementation fails each check with probability 0.1%. Seeds are fixed, so a run is reproducible.
"""

import itertools

import pytest
import torch
from conftest import tiny_target
from scipy.stats import chisquare
from transformers.generation import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import hf_dspark
import hf_dspark.generation
from hf_dspark import DSparkDraftModel

VOCAB = 6
PROMPT = torch.tensor([[1, 4, 2]])
ALPHA = 1e-3
SAMPLES = 1500


def _processors(temperature, top_k=None, top_p=None):
    procs = [TemperatureLogitsWarper(temperature)]  # the order transformers builds them in
    if top_k:
        procs.append(TopKLogitsWarper(top_k))
    if top_p:
        procs.append(TopPLogitsWarper(top_p))
    return LogitsProcessorList(procs)


@torch.no_grad()
def exact_distribution(target, processors, n_tokens=3):
    """P(x_1..x_n | prompt) under the processed target, by enumeration over all prefixes."""
    probs = {}
    for seq in itertools.product(range(VOCAB), repeat=n_tokens):
        ids = torch.cat([PROMPT, torch.tensor([seq])], dim=1)
        logits = target(ids).logits[0, PROMPT.shape[1] - 1 : -1].double()
        p = 1.0
        for i, tok in enumerate(seq):
            scores = processors(ids[:, : PROMPT.shape[1] + i], logits[i : i + 1])
            p *= torch.softmax(scores, -1)[0, tok].item()
        probs[seq] = p
    return probs


def sample_counts(target, draft, gen_kwargs, n=SAMPLES, seed=0, custom_generate=False):
    """Counts of the first 3 new tokens over n DSpark generations; ``draft.seen`` totals the per-call stats.
    ``custom_generate``: call ``generate(custom_generate=hf_dspark.dspark_generate, draft=draft)`` instead of
    ``generate(assistant_model=draft)``."""
    torch.manual_seed(seed)
    route = (
        dict(custom_generate=hf_dspark.dspark_generate, draft=draft) if custom_generate else {"assistant_model": draft}
    )
    counts = {}
    draft.seen = {"proposed": 0, "accepted": 0, "lengths": set(), "looked_up_proposed": 0, "looked_up_accepted": 0}
    for _ in range(n):
        out = target.generate(PROMPT, max_new_tokens=6, do_sample=True, **route, **gen_kwargs)
        key = tuple(out[0, PROMPT.shape[1] : PROMPT.shape[1] + 3].tolist())
        counts[key] = counts.get(key, 0) + 1
        draft.seen["proposed"] += sum(draft.stats.proposed)
        draft.seen["accepted"] += sum(draft.stats.accepted)
        draft.seen["lengths"] |= {n for rnd in draft.stats.verify_rounds for n in rnd}
        s = draft.stats
        draft.seen["looked_up_proposed"] += sum(p for p, lk in zip(s.proposed, s.looked_up, strict=True) if lk)
        draft.seen["looked_up_accepted"] += sum(a for a, lk in zip(s.accepted, s.looked_up, strict=True) if lk)
    return counts


def chi_square_pvalue(counts, probs):
    n = sum(counts.values())
    assert set(counts) <= {k for k, p in probs.items() if p > 0}, "sampled a sequence of probability zero"
    observed, expected, pooled_o, pooled_e = [], [], 0, 0.0
    for key, p in probs.items():
        if n * p >= 5:
            observed.append(counts.get(key, 0))
            expected.append(n * p)
        else:
            pooled_o += counts.get(key, 0)
            pooled_e += n * p
    if pooled_e > 0:
        observed.append(pooled_o)
        expected.append(pooled_e)
    scale = sum(observed) / sum(expected)
    return chisquare(observed, [e * scale for e in expected]).pvalue


CASES = {
    "temperature": dict(temperature=0.7, top_k=0, top_p=1.0),
    "top-k-top-p": dict(temperature=1.3, top_k=4, top_p=0.8),
}


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)  # tiny models: thread hand-offs cost more than the math
    return tiny_target("llama", vocab_size=VOCAB, dtype=torch.float64, seed=3, tie_word_embeddings=False)


@pytest.mark.parametrize(
    ("head", "case"),
    [("none", "top-k-top-p"), ("markov", "top-k-top-p"), ("gated", "top-k-top-p"), ("rnn", "top-k-top-p"),
     ("markov", "temperature")],
)  # fmt: skip
def test_sampling_matches_target_distribution(target, head, case):
    """Every head type with temperature 1.3 + top-k + top-p; the Markov head also with a temperature alone."""
    kw = CASES[case]
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type=head, head_rank=4)
    draft.config.verify_mode = "fixed"  # verify all γ: the most rejection sampling per sample
    torch.manual_seed(1)
    with torch.no_grad():  # make the head matter: random (not neutral) Markov weights
        if draft.sequential_head is not None:
            draft.sequential_head.markov_w2.weight.normal_(0, 2.0)
    probs = exact_distribution(target, _processors(kw["temperature"], kw["top_k"], kw["top_p"]))
    counts = sample_counts(target, draft, kw)
    assert chi_square_pvalue(counts, probs) > ALPHA
    # the draft really was exercised: some proposals rejected, some accepted
    assert 0 < draft.seen["accepted"] < draft.seen["proposed"]


@pytest.mark.parametrize("mode", ["scheduled", "async", "threshold"])
def test_sampling_is_lossless_with_confidence_scheduled_verification(target, mode):
    from hf_dspark.scheduler import SPSProfile

    kw = CASES["top-k-top-p"]
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="markov", head_rank=4)
    torch.manual_seed(2)
    with torch.no_grad():
        draft.sequential_head.markov_w2.weight.normal_(0, 2.0)
        draft.confidence.confidence_head.weight.normal_(0, 1.0)
    draft.config.verify_mode = mode
    draft.sps_profile = SPSProfile.from_callable(lambda B: 1.0 / (1.0 + 0.3 * B))
    probs = exact_distribution(target, _processors(kw["temperature"], kw["top_k"], kw["top_p"]))
    counts = sample_counts(target, draft, kw)
    assert chi_square_pvalue(counts, probs) > ALPHA
    assert len(draft.seen["lengths"]) > 1  # the verify length really varied with the confidences
    assert 0 < draft.seen["accepted"] < draft.seen["proposed"]


def test_broken_acceptance_rule_is_detected(target, monkeypatch):
    """Accepting every draft token (skipping the p/q test) yields the draft's distribution, and the test sees it."""

    def accept_all(draft_tokens, draft_probs, target_probs, generator=None):
        n = draft_tokens.shape[0]
        return n, torch.multinomial(target_probs[n], 1)[0]

    monkeypatch.setattr(hf_dspark.verify, "rejection_sample", accept_all)
    kw = CASES["temperature"]
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="markov", head_rank=4)
    draft.config.verify_mode = "fixed"
    probs = exact_distribution(target, _processors(kw["temperature"]))
    counts = sample_counts(target, draft, kw, n=600)
    assert chi_square_pvalue(counts, probs) < 1e-6


def test_sampling_is_lossless_with_a_draft_vocabulary(target, monkeypatch):
    """A draft restricted to tokens {0, 2, 3} never proposes another token, and the samples still follow the
    target's distribution (which puts mass on all six tokens)."""
    kw = CASES["top-k-top-p"]
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="markov", head_rank=4)
    draft.config.verify_mode = "fixed"
    torch.manual_seed(5)
    with torch.no_grad():
        draft.sequential_head.markov_w2.weight.normal_(0, 2.0)
    draft.set_draft_vocab([3, 0, 2])
    proposed = set()
    original = hf_dspark.generation.draft_block

    def spy(*args, **kwargs):
        proposal = original(*args, **kwargs)
        proposed.update(proposal.tokens.flatten().tolist())
        if proposal.tokens.numel():
            assert proposal.probs[..., [1, 4, 5]].abs().max() == 0  # q is exactly zero outside the subset
        return proposal

    monkeypatch.setattr(hf_dspark.generation, "draft_block", spy)
    probs = exact_distribution(target, _processors(kw["temperature"], kw["top_k"], kw["top_p"]))
    counts = sample_counts(target, draft, kw)
    assert proposed <= {0, 2, 3} and len(proposed) > 1
    assert chi_square_pvalue(counts, probs) > ALPHA
    assert {t for k in counts for t in k} - {0, 2, 3}  # the target's own tokens outside the subset appear
    assert 0 < draft.seen["accepted"] < draft.seen["proposed"]
