"""Lookup drafting: the n-gram matcher by hand, the config checks, and decoding with it stays exactly the target's
(greedy token for token, one row and batched; sampling by a chi-square test)."""

import pytest
import torch
from helpers import CASES, PAD, PROMPTS, chi_square_pvalue, exact_distribution, left_pad, processors, sample_counts

from hf_dspark import DecodingConfig, DSparkConfig, DSparkDraftModel, dspark_generate
from hf_dspark.decoding import verify
from hf_dspark.decoding.lookup import lookup_continuation, one_hot_probs
from hf_dspark.scheduling.policy import SPSProfile
from hf_dspark.testing import tiny_target


def _lookup(history, max_ngram=2, min_ngram=1, max_tokens=8):
    return lookup_continuation(torch.tensor(history), max_ngram, min_ngram, max_tokens).tolist()


@pytest.mark.parametrize(
    ("history", "max_ngram", "min_ngram", "max_tokens", "expected"),
    [
        ([1, 2, 3, 4, 1, 2], 2, 1, 3, [3, 4, 1]),  # the bigram (1, 2) occurred at 0
        ([1, 2, 5, 1, 2, 7, 1, 2], 2, 1, 3, [7, 1, 2]),  # the latest earlier occurrence wins
        ([9, 2, 5, 3, 2, 6, 9, 2], 2, 1, 6, [5, 3, 2, 6, 9, 2]),  # a bigram match beats a later unigram one
        ([9, 2, 5, 3, 2, 6, 9, 2], 1, 1, 3, [6, 9, 2]),  # unigrams only: the latest earlier 2
        ([9, 2, 5, 3, 2, 6, 8, 2], 2, 2, 8, []),  # (8, 2) never occurred and unigrams are not allowed
        ([1, 2, 1], 2, 1, 5, [2, 1, 2, 1, 2]),  # a repeat 2 tokens back: period 2, proposed in full
        ([4, 1, 2, 3, 1, 2], 2, 1, 7, [3, 1, 2, 3, 1, 2, 3]),  # period 3
        ([1, 1, 1, 1], 3, 1, 2, [1, 1]),  # max_tokens caps it
        ([4, 5, 6], 2, 1, 8, []),  # nothing repeats
        ([7], 2, 1, 8, []),  # a single token has no earlier n-gram
        ([1, 2, 1], 2, 1, 0, []),  # no room
    ],
)
def test_lookup_continuation_by_hand(history, max_ngram, min_ngram, max_tokens, expected):
    assert _lookup(history, max_ngram, min_ngram, max_tokens) == expected


@pytest.mark.parametrize(("max_ngram", "min_ngram"), [(2, 0), (1, 2)])
def test_lookup_continuation_refuses_bad_ngram_sizes(max_ngram, min_ngram):
    with pytest.raises(ValueError, match="min_ngram"):
        lookup_continuation(torch.tensor([1, 2, 1]), max_ngram, min_ngram, 4)


def test_one_hot_probs():
    q = one_hot_probs(torch.tensor([2, 0]), 4)
    assert q.dtype == torch.float32 and q.tolist() == [[0, 0, 1, 0], [1, 0, 0, 0]]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"lookup_max_ngram": -1}, r"lookup_max_ngram must be an int from 0 \(off\) to 64, got -1"),
        ({"lookup_max_ngram": 65}, r"lookup_max_ngram must be an int from 0 \(off\) to 64, got 65"),
        ({"lookup_max_ngram": 2, "lookup_min_ngram": 3}, r"lookup_min_ngram must be an int between 1 and .*\(2\)"),
        ({"lookup_max_ngram": 2, "lookup_min_ngram": 0}, "lookup_min_ngram must be an int between 1"),
        ({"lookup_max_tokens": 0}, r"lookup_max_tokens must be an int from 1 to 256 \(or None: γ\), got 0"),
        ({"lookup_max_tokens": 2.5}, "lookup_max_tokens must be an int from 1 to 256"),
        ({"lookup_max_tokens": True}, "lookup_max_tokens must be an int from 1 to 256"),
        ({"lookup_adaptive": 1}, "lookup_adaptive must be True or False, got 1"),
        ({"lookup_adaptive": "yes"}, "lookup_adaptive must be True or False"),
    ],
)
def test_config_refuses_bad_lookup_fields(fields, message):
    with pytest.raises(ValueError, match=message):
        DSparkConfig(**fields)


def test_bad_lookup_fields_set_on_a_loaded_draft_are_refused_where_they_are_set():
    target = tiny_target()
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    draft.decoding.lookup_max_ngram = 2
    with pytest.raises(ValueError, match=r"lookup_min_ngram must be an int between 1 and lookup_max_ngram \(2\)"):
        draft.decoding.lookup_min_ngram = 5
    assert draft.decoding.lookup_min_ngram == 2  # the old value stays, and generate runs with it
    target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False, assistant_model=draft)


def test_lookup_fields_survive_save_and_load(tmp_path):
    target = tiny_target()
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    draft.decoding.lookup_max_ngram, draft.decoding.lookup_min_ngram, draft.decoding.lookup_max_tokens = 3, 1, 12
    draft.decoding.lookup_adaptive = True
    draft.save_pretrained(tmp_path)
    loaded = DecodingConfig.from_pretrained(tmp_path)
    assert (loaded.lookup_max_ngram, loaded.lookup_min_ngram, loaded.lookup_max_tokens) == (3, 1, 12)
    assert loaded.lookup_adaptive is True
    assert DecodingConfig().lookup_max_ngram == 0  # off unless asked for
    assert DecodingConfig().lookup_max_tokens is None  # a continuation as long as a block unless asked for
    assert DecodingConfig().lookup_adaptive is False  # a fixed width unless asked for


# a prompt that repeats itself, so lookups match from the first round on
REPEATING = torch.tensor([[5, 17, 33, 2, 9, 41, 8, 5, 17, 33, 2, 9]])


@pytest.mark.parametrize("mode", ["fixed", "scheduled"])
@pytest.mark.parametrize("min_ngram", [1, 2])
def test_greedy_with_lookup_equals_plain_greedy(mode, min_ngram):
    target = tiny_target(dtype=torch.float64)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    draft.decoding.verify_mode = mode
    draft.sps_profile = SPSProfile.from_callable(lambda B: 1.0 / (1.0 + 0.1 * B))
    draft.decoding.lookup_max_ngram, draft.decoding.lookup_min_ngram = 3, min_ngram
    for ids in (REPEATING, torch.tensor([[40, 3, 77, 12]])):
        ref = target.generate(ids, max_new_tokens=40, do_sample=False)
        out = target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=draft)
        assert out.tolist() == ref.tolist()
        stats = draft.stats
        assert sum(stats.committed) == 39
        assert len(stats.looked_up) == stats.rounds
        # both kinds of round happened, and lookups were not only proposed but accepted
        assert any(stats.looked_up) and not all(stats.looked_up)
        assert sum(a for a, lk in zip(stats.accepted, stats.looked_up, strict=True) if lk) > 0
        # the confidences line up with the entries: None for a looked-up one, one per verified token otherwise
        assert len(stats.confidences) == stats.rounds
        for conf, looked, ell in zip(stats.confidences, stats.looked_up, stats.proposed, strict=True):
            assert conf is None if looked else len(conf) == ell


@pytest.mark.parametrize("mode", ["fixed", "scheduled"])
def test_lookup_continuations_longer_than_a_block_stay_exact_and_respect_verify_limit(mode):
    """``lookup_max_tokens`` past γ: looked-up rounds verify up to it (drafted ones still up to γ), the output is
    plain greedy's, and ``verify_limit`` caps both."""
    target = tiny_target(dtype=torch.float64)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    draft.decoding.verify_mode = mode
    draft.sps_profile = SPSProfile.from_callable(lambda B: 1.0 / (1.0 + 0.1 * B))
    draft.decoding.lookup_max_ngram, draft.decoding.lookup_min_ngram, draft.decoding.lookup_max_tokens = 3, 1, 10
    ref = target.generate(REPEATING, max_new_tokens=40, do_sample=False)
    out = target.generate(REPEATING, max_new_tokens=40, do_sample=False, assistant_model=draft)
    assert out.tolist() == ref.tolist()
    stats = draft.stats
    assert sum(stats.committed) == 39
    looked = [p for p, lk in zip(stats.proposed, stats.looked_up, strict=True) if lk]
    drafted = [p for p, lk in zip(stats.proposed, stats.looked_up, strict=True) if not lk]
    gamma = draft.config.num_draft_tokens
    assert gamma < max(looked) <= 10 and max(drafted, default=0) <= gamma
    # longer continuations were not only proposed but accepted past γ
    assert any(a > gamma for a, lk in zip(stats.accepted, stats.looked_up, strict=True) if lk)
    assert len(stats.position_acceptance()) == gamma

    draft.decoding.verify_limit = 2
    out = target.generate(REPEATING, max_new_tokens=40, do_sample=False, assistant_model=draft)
    assert out.tolist() == ref.tolist()
    assert max(draft.stats.proposed) <= 2 and any(draft.stats.looked_up)


@pytest.mark.parametrize("mode", ["fixed", "scheduled"])
def test_adaptive_lookups_grow_while_accepted_in_full_and_stay_exact(mode):
    """``lookup_adaptive``: the first lookup verifies γ, each one accepted in full doubles the next (from its own
    length, never below γ, up to ``lookup_max_tokens``), one cut short sets it back to γ; drafted rounds in
    between change nothing. Output: plain greedy's."""
    target = tiny_target(dtype=torch.float64)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    draft.decoding.verify_mode = mode
    draft.sps_profile = SPSProfile.from_callable(lambda B: 1.0 / (1.0 + 0.1 * B))
    draft.decoding.lookup_max_ngram, draft.decoding.lookup_min_ngram = 3, 1
    draft.decoding.lookup_max_tokens, draft.decoding.lookup_adaptive = 12, True
    gamma, new_tokens = draft.config.num_draft_tokens, 60
    for ids in (REPEATING, torch.tensor([[40, 3, 77, 12]])):
        ref = target.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        out = target.generate(ids, max_new_tokens=new_tokens, do_sample=False, assistant_model=draft)
        assert out.tolist() == ref.tolist()
    stats = draft.stats  # the last prompt's
    width, produced, grew, reset = gamma, 1, False, False
    for proposed, accepted, committed, looked in zip(
        stats.proposed, stats.accepted, stats.committed, stats.looked_up, strict=True
    ):
        if looked:
            assert proposed == min(width, new_tokens - produced - 1)
            whole = accepted == proposed
            grew, reset = grew or (whole and proposed < 12), reset or not whole
            width = max(gamma, min(2 * proposed, 12)) if whole else gamma
        else:
            assert proposed <= gamma
        produced += committed
    assert grew and reset  # both branches of the rule were taken
    assert max(stats.proposed) > gamma


def test_adaptive_lookup_width_grows_in_tree_rounds_too():
    """Trees look up through the same proposer and the same width rule: the first looked-up branch is at most γ
    deep, later ones grow past it while accepted whole. Output: plain greedy's."""
    target = tiny_target(dtype=torch.float64)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    draft.decoding.verify_mode, draft.decoding.tree_top_k = "fixed", 2
    draft.decoding.lookup_max_ngram, draft.decoding.lookup_min_ngram = 3, 1
    draft.decoding.lookup_max_tokens, draft.decoding.lookup_adaptive = 12, True
    gamma = draft.config.num_draft_tokens
    ref = target.generate(REPEATING, max_new_tokens=60, do_sample=False)
    out = target.generate(REPEATING, max_new_tokens=60, do_sample=False, custom_generate=dspark_generate, draft=draft)
    assert out.tolist() == ref.tolist()
    stats = draft.stats
    assert stats.tree_fallback is None
    depths = [depth for depth, looked in zip(stats.depths, stats.looked_up, strict=True) if looked]
    assert depths[0] <= gamma < max(depths)


def test_adaptive_lookup_width_rule():
    """The width rule on its own, one rule for chains and trees: a short continuation accepted whole earns twice
    its length but never less than γ, a long one at most ``lookup_max_tokens``, and one cut short goes back to γ."""
    from hf_dspark.decoding.lookup import LookupProposer

    draft = DSparkDraftModel.from_target(tiny_target(), block_size=4, head_rank=8)
    draft.decoding.lookup_max_ngram, draft.decoding.lookup_max_tokens, draft.decoding.lookup_adaptive = 3, 12, True
    gamma = draft.config.num_draft_tokens
    lookup = LookupProposer.of(draft.decoding.resolve(draft.confidence is not None), gamma)

    def verified(found: int, accepted: int) -> int:
        lookup.observe_width(found, accepted)
        return lookup.width

    assert gamma > 2 and lookup.width == gamma
    assert verified(found=1, accepted=1) == gamma
    assert verified(found=gamma, accepted=gamma) == min(2 * gamma, 12)
    assert verified(found=12, accepted=12) == 12
    assert verified(found=12, accepted=5) == gamma
    draft.decoding.lookup_adaptive = False
    lookup = LookupProposer.of(draft.decoding.resolve(draft.confidence is not None), gamma)
    assert verified(found=gamma, accepted=gamma) == 12  # the rule is off: always lookup_max_tokens
    draft.decoding.lookup_max_ngram = 0
    assert LookupProposer.of(draft.decoding.resolve(draft.confidence is not None), gamma) is None


def test_a_round_where_every_row_looks_up_does_not_draft(monkeypatch):
    from hf_dspark.decoding import proposers

    target = tiny_target(dtype=torch.float64)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    draft.decoding.verify_mode = "fixed"
    draft.decoding.lookup_max_ngram, draft.decoding.lookup_min_ngram = 2, 1
    drafted = []
    original = proposers.draft_block

    def spy(draft_, context, histories, anchor_positions, max_tokens, *args, **kwargs):
        drafted.append(max_tokens)
        return original(draft_, context, histories, anchor_positions, max_tokens, *args, **kwargs)

    monkeypatch.setattr(proposers, "draft_block", spy)
    target.generate(REPEATING, max_new_tokens=30, do_sample=False, assistant_model=draft)
    stats = draft.stats
    # one draft_block call per round, asked for nothing when the row looked up, else for what it verifies (fixed)
    assert drafted == [0 if lk else p for p, lk in zip(stats.proposed, stats.looked_up, strict=True)]
    assert any(stats.looked_up) and 4 in drafted


@pytest.mark.parametrize("mode", ["fixed", "scheduled"])
def test_batched_greedy_with_lookup_equals_per_row_plain_greedy_and_looks_up_only_with_one_row_left(mode):
    """In a batch the verify block's width is shared, so rows look up only once they are the last row running."""
    target = tiny_target(dtype=torch.float64)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    draft.decoding.verify_mode = mode
    draft.sps_profile = SPSProfile.from_callable(lambda B: 1.0 / (1.0 + 0.1 * B))
    draft.decoding.lookup_max_ngram, draft.decoding.lookup_min_ngram = 2, 1
    prompts = [PROMPTS[1], PROMPTS[2], REPEATING[0].tolist()]
    free = [target.generate(torch.tensor([p]), max_new_tokens=30, do_sample=False)[0, len(p) :] for p in prompts]
    # an EOS the short prompts produce early and the repeating row never does: it then runs alone to the end
    eos = next(int(x) for x in free[0] if int(x) not in free[-1].tolist() and int(x) in free[1].tolist())

    def new(row):
        row = row.tolist()
        return row[: row.index(eos) + 1] if eos in row else row

    refs = [new(f) for f in free]
    assert len(refs[-1]) == 30 and max(len(r) for r in refs[:-1]) < 30
    ids, mask = left_pad(prompts)
    out = target.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=30,
        do_sample=False,
        pad_token_id=PAD,
        eos_token_id=eos,
        assistant_model=draft,
    )
    for r, ref in enumerate(refs):
        assert new(out[r, ids.shape[1] :]) == ref, f"row {r}"
    flags = iter(draft.stats.looked_up)
    per_round = [(len(rnd), [next(flags) for _ in rnd]) for rnd in draft.stats.verify_rounds]
    assert not any(any(f) for n, f in per_round if n > 1)  # no lookup while several rows share the block
    assert any(f == [True] for n, f in per_round if n == 1)  # the last row alone looked up


@pytest.fixture(scope="module")
def small_vocab_target():
    torch.set_num_threads(1)
    return tiny_target("llama", vocab_size=6, dtype=torch.float64, seed=3, tie_word_embeddings=False)


def test_sampling_with_lookup_matches_target_distribution(small_vocab_target):
    """With six tokens, unigram lookups match almost every round; the samples still follow the target's processed
    distribution, and looked-up tokens were both accepted and rejected (the one-hot q is exercised)."""
    target, kw = small_vocab_target, CASES["top-k-top-p"]
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="markov", head_rank=4)
    draft.decoding.verify_mode = "fixed"
    draft.decoding.lookup_max_ngram, draft.decoding.lookup_min_ngram = 2, 1
    probs = exact_distribution(target, processors(kw["temperature"], kw["top_k"], kw["top_p"]))
    counts = sample_counts(target, draft, kw, seed=7)
    assert chi_square_pvalue(counts, probs) > 1e-3
    assert 0 < draft.seen["looked_up_accepted"] < draft.seen["looked_up_proposed"]


def test_sampling_test_sees_a_lookup_accepted_without_the_ratio_test(small_vocab_target, monkeypatch):
    """Treating a looked-up token as always accepted (q = p, no test) is caught by the same check."""
    original = verify.rejection_sample

    def lenient(draft_tokens, draft_probs, target_probs, generator=None):
        if draft_tokens.shape[0] and bool((draft_probs.amax(-1) == 1).all()):  # a looked-up chain: q is one-hot
            n = draft_tokens.shape[0]
            return n, torch.multinomial(target_probs[n], 1)[0]
        return original(draft_tokens, draft_probs, target_probs, generator)

    monkeypatch.setattr(verify, "rejection_sample", lenient)
    target, kw = small_vocab_target, CASES["top-k-top-p"]
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="markov", head_rank=4)
    draft.decoding.verify_mode = "fixed"
    draft.decoding.lookup_max_ngram, draft.decoding.lookup_min_ngram = 2, 1
    probs = exact_distribution(target, processors(kw["temperature"], kw["top_k"], kw["top_p"]))
    counts = sample_counts(target, draft, kw, n=600)
    assert chi_square_pvalue(counts, probs) < 1e-6


def test_bench_methods_pass_their_own_lookup_settings_to_the_shared_draft():
    """Bench methods share one draft: a plain DSpark method run after a lookup one must not inherit lookup, and
    none of them changes the draft's saved settings (each passes its own per call)."""
    from hf_dspark.evaluation.bench import standard_methods

    target = tiny_target(dtype=torch.float64)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    draft.sps_profile = SPSProfile.from_callable(lambda B: 1.0 / (1.0 + 0.1 * B))
    methods = {m.name: m for m in standard_methods(target, {"d": draft}, gammas=(), lookup=3, lookup_min=1)}
    assert list(methods) == ["plain", "prompt-lookup", "d-scheduled", "d-scheduled+lookup"]
    ref = target.generate(REPEATING, max_new_tokens=20, do_sample=False)
    for name in ["d-scheduled+lookup", "d-scheduled", "d-scheduled+lookup"]:
        out = methods[name].run(REPEATING, max_new_tokens=20, do_sample=False)
        assert out.tolist() == ref.tolist()
        assert any(draft.stats.looked_up) == name.endswith("+lookup")
        assert draft.decoding == DecodingConfig()


def test_eval_measures_the_draft_alone_unless_asked_for_lookup(tmp_path):
    import json

    from hf_dspark.evaluation.evaluate import evaluate
    from hf_dspark.testing import char_tokenizer

    target = tiny_target("llama", vocab_size=96, eos_token_id=1)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    draft.decoding.verify_mode = "fixed"
    draft.decoding.lookup_max_ngram = 3  # as the shipped draft's config has it
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [t]}) for t in ["abcabcabcabc", "hello hello hello"]))
    tok = char_tokenizer()
    alone = evaluate(target, tok, draft, str(prompts), max_new_tokens=24, progress=False)
    assert alone["lookup_max_ngram"] == 0 and not any(draft.stats.looked_up)
    assert draft.decoding.lookup_max_ngram == 3  # restored
    mixed = evaluate(
        target, tok, draft, str(prompts), max_new_tokens=24, progress=False, settings={"lookup_max_ngram": 2}
    )
    assert mixed["lookup_max_ngram"] == 2 and any(draft.stats.looked_up)
    assert draft.decoding.lookup_max_ngram == 3
