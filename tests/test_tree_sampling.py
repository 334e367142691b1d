"""Token trees sample exactly: the first generated tokens follow the target's processed distribution (chi-square,
α = 1e-3, as in test_sampling.py), whatever the tree's children, and a biased walk is caught."""

import pytest
import torch
from helpers import (
    ALPHA,
    CASES,
    PROMPT,
    SAMPLES,
    VOCAB,
    chi_square_pvalue,
    exact_distribution,
    left_pad,
    processors,
    sample_counts,
)
from transformers.generation import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from hf_dspark import DSparkDraftModel
from hf_dspark.decoding import verification
from hf_dspark.testing import tiny_target


@pytest.fixture(scope="module")
def small_target():
    torch.set_num_threads(1)
    return tiny_target("llama", vocab_size=VOCAB, dtype=torch.float64, seed=3, tie_word_embeddings=False)


def _sampling_draft(target, head="markov"):
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type=head, head_rank=4)
    torch.manual_seed(1)
    with torch.no_grad():
        if draft.sequential_head is not None:
            draft.sequential_head.markov_w2.weight.normal_(0, 2.0)
    return draft


def _tree_nodes_taken(draft):
    return draft.seen["accepted"], draft.seen["proposed"]


@pytest.mark.parametrize(("case", "top_k"), [("temperature", 2), ("top-k-top-p", 3), ("temperature-top-p", 4)])
def test_tree_sampling_matches_target_distribution(small_target, case, top_k):
    kw = CASES[case]
    draft = _sampling_draft(small_target)
    probs = exact_distribution(small_target, processors(kw["temperature"], kw["top_k"], kw["top_p"]))
    counts = sample_counts(small_target, draft, {**kw, "tree_top_k": top_k, "verify_mode": "fixed"},
                           custom_generate=True)  # fmt: skip
    assert chi_square_pvalue(counts, probs) > ALPHA
    accepted, proposed = _tree_nodes_taken(draft)
    assert 0 < accepted < proposed


def test_tree_sampling_with_repetition_penalty_matches_target_distribution(small_target):
    draft = _sampling_draft(small_target, head="rnn")
    procs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.8), *processors(1.0)])
    probs = exact_distribution(small_target, procs)
    counts = sample_counts(small_target, draft, {"repetition_penalty": 1.8, "temperature": 1.0, "top_k": 0,
                           "tree_top_k": 2, "verify_mode": "fixed"}, custom_generate=True)  # fmt: skip
    assert chi_square_pvalue(counts, probs) > ALPHA


def test_batched_tree_sampling_matches_target_distribution(small_target):
    """A row of a left-padded batch (the other row longer, with a tree of its own in the same verify) samples the
    target exactly: its mask, positions and cache compaction leave its distribution untouched."""
    import hf_dspark

    draft = _sampling_draft(small_target)
    kw = CASES["top-k-top-p"]
    probs = exact_distribution(small_target, processors(kw["temperature"], kw["top_k"], kw["top_p"]))
    ids, mask = left_pad([PROMPT[0].tolist(), [3, 5, 1, 4, 2, 5]])
    torch.manual_seed(0)
    counts, batched = {}, 0
    for _ in range(SAMPLES):
        out = small_target.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, pad_token_id=0,
                                    custom_generate=hf_dspark.dspark_generate, draft=draft, tree_top_k=2,
                                    verify_mode="fixed", **kw)  # fmt: skip
        key = tuple(out[0, ids.shape[1] : ids.shape[1] + 3].tolist())
        counts[key] = counts.get(key, 0) + 1
        batched += sum(len(rows) == 2 and min(rows) > 1 for rows in draft.stats.verify_rounds)
    assert draft.stats.tree_fallback is None and batched > SAMPLES  # both rows verified trees together
    assert chi_square_pvalue(counts, probs) > ALPHA


def test_tree_sampling_is_exact_when_the_drafts_children_miss_the_targets_mass(small_target):
    """Adversarial: the draft's top children are the target's least likely tokens at the prompt; the walk then
    rarely descends, and the committed tokens still follow the target exactly."""
    draft = DSparkDraftModel.from_target(small_target, block_size=4, head_type="none", confidence_head=False)
    with torch.no_grad():
        first = small_target(torch.tensor([[1, 4, 2]])).logits[0, -1]
    original = draft.forward

    def reversed_preferences(block_embeds, block_positions, context, attention_mask=None, compute_logits=True,
                             context_positions=None):  # fmt: skip
        out = original(block_embeds, block_positions, context, attention_mask, compute_logits)
        out.logits = (-10 * first).to(out.logits).expand_as(out.logits).clone()
        return out

    draft.forward = reversed_preferences
    kw = CASES["temperature"]
    probs = exact_distribution(small_target, processors(kw["temperature"]))
    counts = sample_counts(small_target, draft, {**kw, "tree_top_k": 2, "verify_mode": "fixed"},
                           custom_generate=True)  # fmt: skip
    assert chi_square_pvalue(counts, probs) > ALPHA
    accepted, proposed = _tree_nodes_taken(draft)
    assert accepted < 0.1 * proposed


def test_a_walk_that_favours_the_top_child_is_detected(small_target, monkeypatch):
    """Guard: descending into the draft's first child whenever the target's choice is any child (a plausible
    bug) changes the distribution, and the chi-square test sees it."""
    real_walk = verification.walk

    def biased(verified, raw, history, procs, do_sample):
        result = real_walk(verified, raw, history, procs, do_sample)
        if result.slots:
            first = min(s for (p, _), s in verified.children.items() if p == 0)
            return type(result)([first], result.next_token, result.scores[:2])
        return result

    monkeypatch.setattr(verification, "walk", biased)
    kw = CASES["temperature"]
    draft = _sampling_draft(small_target)
    probs = exact_distribution(small_target, processors(kw["temperature"]))
    counts = sample_counts(small_target, draft, {**kw, "tree_top_k": 3, "verify_mode": "fixed"},
                           custom_generate=True)  # fmt: skip
    assert chi_square_pvalue(counts, probs) < ALPHA


def test_recursive_rejection_over_deterministic_and_sampled_children_follows_the_target():
    """One slot with a deterministic child (token 0, a lookup's) and a child drawn from q (the draft's, merged into
    the first whenever the draw is 0): the token the slot commits, descended into or drawn after both rejections,
    follows p exactly (chi-square over 4,000 walks, a fresh draw from q each)."""
    from hf_dspark.decoding.tree import TokenTree, VerifiedTree
    from hf_dspark.decoding.verify import walk

    torch.manual_seed(0)
    p = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    q = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    raw = torch.log(p)[None].expand(3, -1)
    counts, merged, descended = {}, 0, 0
    for _ in range(4000):
        tree = TokenTree()
        tree.add(-1, 0, 0.5, "lookup")
        x = int(torch.multinomial(q, 1))
        tree.add(-1, x, 0.5, "draft", top=True, probs=q)
        verified = VerifiedTree.of(tree, list(range(len(tree))))
        merged += x == 0
        result = walk(verified, raw, torch.tensor([1]), LogitsProcessorList(), do_sample=True)
        token = int(verified.slot_tokens[result.slots[0] - 1]) if result.slots else int(result.next_token)
        descended += bool(result.slots)
        counts[(token,)] = counts.get((token,), 0) + 1
    assert merged > 200 and 0 < descended < 4000  # both kinds of round, and the merged node, were walked
    assert chi_square_pvalue(counts, {(t,): float(p[t]) for t in range(4)}) > ALPHA


def test_a_tree_narrowed_to_the_chain_samples_its_child_and_stays_exact(small_target, monkeypatch):
    """Narrowed tree rounds (width one) under sampling draw their child from q and accept it against q, as a chain
    does (rejection sampling over the tree's chain), instead of taking the draft's top child: the first tokens
    still follow the target, and the draws were tested against their q."""
    from hf_dspark.decoding import tree_rounds, verify

    real_requests, tested = tree_rounds.TreeRounds.requests, []

    def narrowed(self, *args, **kwargs):
        requests = real_requests(self, *args, **kwargs)
        for request in requests:
            request.top_k = 1  # every drafted round narrowed to the chain
        return requests

    real_rejection = verify.rejection_sample
    monkeypatch.setattr(tree_rounds.TreeRounds, "requests", narrowed)
    monkeypatch.setattr(verify, "rejection_sample", lambda *a, **k: tested.append(1) or real_rejection(*a, **k))
    kw = CASES["temperature"]
    draft = _sampling_draft(small_target)
    probs = exact_distribution(small_target, processors(kw["temperature"]))
    counts = sample_counts(small_target, draft, {**kw, "tree_top_k": 2, "verify_mode": "fixed"},
                           custom_generate=True)  # fmt: skip
    assert chi_square_pvalue(counts, probs) > ALPHA
    accepted, proposed = _tree_nodes_taken(draft)
    assert tested and 0 < accepted < proposed
