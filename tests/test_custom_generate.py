"""``target.generate(custom_generate=hf_dspark.dspark_generate, draft=draft)``: transformers' public extension point,
with hf-dspark's ``assistant_model`` patch switched off, so nothing but the public route is exercised."""

import inspect

import pytest
import torch
from helpers import ALPHA, CASES, chi_square_pvalue, exact_distribution, noisy_markov_draft, processors, sample_counts
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import hf_dspark
from hf_dspark import DecodingConfig, DSparkDraftModel, dspark_generate
from hf_dspark.decoding.versions import CACHE_FIELD
from hf_dspark.scheduling.policy import SPSProfile
from hf_dspark.testing import tiny_target


@pytest.fixture(autouse=True)
def no_patch():
    hf_dspark.disable()
    yield
    hf_dspark.enable()


def _draft(target, mode="fixed", seed=0, **kw):
    torch.manual_seed(seed)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8, **kw)
    with torch.no_grad():  # a head that matters, and confidences that vary
        draft.sequential_head.markov_w2.weight.normal_(0, 1.0)
        draft.confidence.confidence_head.weight.normal_(0, 1.0)
    draft.decoding.verify_mode = mode
    draft.sps_profile = SPSProfile.from_callable(lambda B: 1.0)  # verifying is free: every column pays
    return draft


@pytest.mark.parametrize(("arch", "mode"), [("llama", "fixed"), ("llama", "scheduled"), ("qwen3", "threshold")])
def test_greedy_equals_plain_greedy_without_the_patch(arch, mode):
    assert not hf_dspark.is_enabled()
    target = tiny_target(arch, vocab_size=96)
    draft = _draft(target, mode)
    g = torch.Generator().manual_seed(1)
    for length in (3, 9, 17):
        ids = torch.randint(3, 96, (1, length), generator=g)
        ref = target.generate(ids, max_new_tokens=24, do_sample=False)
        out = target.generate(ids, max_new_tokens=24, do_sample=False, custom_generate=dspark_generate, draft=draft)
        assert out.tolist() == ref.tolist()
        assert draft.stats.rounds > 0 and sum(draft.stats.proposed) > 0  # DSpark really ran


def test_left_padded_batch_equals_plain_greedy_per_row():
    target = tiny_target("llama", vocab_size=96)
    draft = _draft(target, "scheduled")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (4, 11, 7)]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = target.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=16,
        do_sample=False,
        pad_token_id=0,
        custom_generate=dspark_generate,
        draft=draft,
    )
    for r, p in enumerate(prompts):
        ref = target.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p) :]
        assert out[r, width:].tolist() == ref.tolist()


def test_return_dict_scores_and_stopping_criteria_as_plain_generate():
    target = tiny_target("llama", vocab_size=96)
    draft = _draft(target)
    ids = torch.tensor([[5, 9, 13, 2, 40]])

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 5 + 7, dtype=torch.bool)

    kw = dict(
        max_new_tokens=20,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
        stopping_criteria=StoppingCriteriaList([StopAfter()]),
    )
    ref = target.generate(ids, **kw)
    out = target.generate(ids, custom_generate=dspark_generate, draft=draft, **kw)
    assert out.sequences.tolist() == ref.sequences.tolist() and out.sequences.shape[1] == 12
    assert len(out.scores) == len(ref.scores) == 7
    for a, b in zip(out.scores, ref.scores, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert getattr(out, CACHE_FIELD) is not None


def test_streamer_given_to_generate_gets_the_prompt_then_every_token_once():
    """``generate`` does not pass ``streamer=`` to a custom_generate callable; dspark_generate finds it anyway."""

    class Recorder(BaseStreamer):
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    target = tiny_target("llama", vocab_size=96)
    draft = _draft(target)
    ids = torch.tensor([[7, 3, 22, 41]])
    ref = target.generate(ids, max_new_tokens=18, do_sample=False)
    streamer = Recorder()
    out = target.generate(
        ids, max_new_tokens=18, do_sample=False, streamer=streamer, custom_generate=dspark_generate, draft=draft
    )
    assert out.tolist() == ref.tolist()
    assert streamer.puts[0] == ids[0].tolist() and streamer.ended
    assert [t for put in streamer.puts[1:] for t in put] == ref[0, 4:].tolist()
    assert len(streamer.puts) - 1 < 18  # several tokens per round, not one put per token


def test_sampling_matches_target_distribution_without_the_patch():
    from helpers import VOCAB

    kw = CASES["top-k-top-p"]
    target = tiny_target("llama", vocab_size=VOCAB, dtype=torch.float64, seed=3, tie_word_embeddings=False)
    draft = noisy_markov_draft(target)
    probs = exact_distribution(target, processors(kw["temperature"], kw["top_k"], kw["top_p"]))
    counts = sample_counts(target, draft, kw, custom_generate=True)
    assert chi_square_pvalue(counts, probs) > ALPHA
    assert 0 < draft.seen["accepted"] < draft.seen["proposed"]


def test_refused_inputs_name_the_problem():
    target = tiny_target("llama", vocab_size=96)
    draft = _draft(target)
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match=r"needs draft=<DSparkDraftModel> \(got no draft\)"):
        target.generate(ids, max_new_tokens=4, custom_generate=dspark_generate)
    with pytest.raises(ValueError, match=r"needs draft=<DSparkDraftModel> \(got LlamaForCausalLM\)"):
        target.generate(ids, max_new_tokens=4, custom_generate=dspark_generate, draft=target)
    other = tiny_target("llama", vocab_size=128)
    with pytest.raises(ValueError, match="vocab"):
        other.generate(ids, max_new_tokens=4, custom_generate=dspark_generate, draft=draft)
    with pytest.raises(ValueError, match="beam search"):
        target.generate(ids, max_new_tokens=4, num_beams=2, custom_generate=dspark_generate, draft=draft)
    with pytest.raises(ValueError, match="num_return_sequences"):
        target.generate(
            ids, max_new_tokens=4, do_sample=True, num_return_sequences=2, custom_generate=dspark_generate, draft=draft
        )
    with pytest.raises(ValueError, match="not used by the model"):
        target.generate(ids, max_new_tokens=4, custom_generate=dspark_generate, draft=draft, verify_modee="x")


def test_per_call_settings_leave_the_saved_config_alone():
    target = tiny_target("llama", vocab_size=96)
    draft = _draft(target, "scheduled")
    before = draft.config.to_dict()
    ids = torch.tensor([[5, 9, 13, 2, 40, 5, 9, 13, 2, 40, 5, 9]])  # repeats: lookups find continuations
    ref = target.generate(ids, max_new_tokens=20, do_sample=False)
    out = target.generate(
        ids,
        max_new_tokens=20,
        do_sample=False,
        custom_generate=dspark_generate,
        draft=draft,
        verify_mode="fixed",
        verify_limit=2,
        return_dict_in_generate=True,
    )
    assert out.sequences.tolist() == ref.tolist()
    assert max(n for rnd in out.dspark_stats.verify_rounds for n in rnd) == 2  # fewer only at the length limit
    assert out.dspark_stats is draft.stats
    looked = target.generate(
        ids,
        max_new_tokens=20,
        do_sample=False,
        custom_generate=dspark_generate,
        draft=draft,
        lookup_max_ngram=3,
        lookup_min_ngram=2,
        lookup_max_tokens=10,
    )
    assert looked.tolist() == ref.tolist() and any(draft.stats.looked_up)
    gamma = draft.config.num_draft_tokens
    assert max(p for p, lk in zip(draft.stats.proposed, draft.stats.looked_up, strict=True) if lk) > gamma
    grown = target.generate(
        ids, max_new_tokens=20, do_sample=False, custom_generate=dspark_generate, draft=draft,
        lookup_max_ngram=3, lookup_min_ngram=2, lookup_max_tokens=10, lookup_adaptive=True,
    )  # fmt: skip
    assert grown.tolist() == ref.tolist()
    first = next(p for p, lk in zip(draft.stats.proposed, draft.stats.looked_up, strict=True) if lk)
    assert first <= gamma  # this call's lookups start at a block's width, the last call's started at 10
    assert draft.config.to_dict() == before
    for bad, message in [
        (dict(verify_mode="fast"), "verify_mode must be one of"),
        (dict(verify_limit=-1), "verify_limit must be an int from 0 to 256"),
        (dict(confidence_threshold=1.5), r"confidence_threshold must lie in \[0, 1\]"),
        (dict(lookup_max_ngram=2, lookup_min_ngram=3), "lookup_min_ngram must be an int between 1 and"),
        (dict(lookup_max_ngram=2, lookup_max_tokens=0), "lookup_max_tokens must be an int from 1 to 256"),
        (dict(lookup_max_ngram=2, lookup_adaptive="on"), "lookup_adaptive must be True or False"),
    ]:
        with pytest.raises(ValueError, match=message):
            target.generate(ids, max_new_tokens=4, custom_generate=dspark_generate, draft=draft, **bad)


def test_two_threads_sharing_a_draft_keep_their_own_settings_and_stats():
    """Two visitors of the demo at once: one shared draft, different verify limits, real threads."""
    import threading

    target = tiny_target("llama", vocab_size=96)
    draft = _draft(target, "fixed")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 96, (1, 6), generator=g) for _ in range(4)]
    refs = [target.generate(p, max_new_tokens=24, do_sample=False).tolist() for p in prompts]

    def call(p, limit):
        return target.generate(
            p,
            max_new_tokens=24,
            do_sample=False,
            custom_generate=dspark_generate,
            draft=draft,
            verify_limit=limit,
            return_dict_in_generate=True,
        )

    alone = {(i, limit): call(p, limit).dspark_stats.verify_rounds for i, p in enumerate(prompts) for limit in (1, 4)}
    results, errors = {}, []

    def worker(limit):
        try:
            for i, p in enumerate(prompts):
                out = call(p, limit)
                results[(i, limit)] = (out.sequences.tolist(), out.dspark_stats.verify_rounds)
        except Exception as e:  # surfaced below: an assertion in a thread would not fail the test
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(limit,)) for limit in (1, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for (i, limit), (sequences, rounds) in results.items():
        assert sequences == refs[i]
        assert rounds == alone[(i, limit)]  # the same rounds as the same call alone
        assert max(n for rnd in rounds for n in rnd) == limit


def test_stop_strings_through_an_explicit_criterion():
    """transformers hands a custom_generate callable no `tokenizer=`, so `stop_strings=` alone is refused by
    transformers itself; the same stop strings as a StopStringCriteria stop exactly where plain generate stops."""
    from transformers import StopStringCriteria

    from hf_dspark.testing import char_tokenizer

    target, tokenizer = tiny_target("llama", vocab_size=96), char_tokenizer()
    draft = _draft(target)
    ids = tokenizer("hello there", return_tensors="pt")["input_ids"]
    text = tokenizer.decode(target.generate(ids, max_new_tokens=30, do_sample=False)[0, ids.shape[1] :])
    stop = text[10:12]
    ref = target.generate(ids, max_new_tokens=30, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    assert ref.shape[1] < ids.shape[1] + 30  # the stop string really stops it
    with pytest.raises(ValueError, match="could not locate a tokenizer"):
        target.generate(
            ids,
            max_new_tokens=30,
            stop_strings=[stop],
            tokenizer=tokenizer,
            custom_generate=dspark_generate,
            draft=draft,
        )
    criteria = StoppingCriteriaList([StopStringCriteria(tokenizer, [stop])])
    out = target.generate(
        ids,
        max_new_tokens=30,
        do_sample=False,
        stopping_criteria=criteria,
        custom_generate=dspark_generate,
        draft=draft,
    )
    assert out.tolist() == ref.tolist()


def test_every_decoding_setting_is_a_keyword_generate_hands_to_the_call(monkeypatch):
    """``dspark_generate``'s signature is generated from ``DecodingConfig``: transformers reads a ``custom_generate``
    callable's signature to decide which of ``generate``'s keywords are the callable's, so every field (a new one
    included) reaches the call's settings by name; one ``generate`` did not hand over would reach the model as an
    unused model kwarg and be refused there."""
    fields = DecodingConfig.field_names()
    params = inspect.signature(dspark_generate).parameters
    assert [name for name in params if name in fields] == list(fields)
    assert all(params[name].kind is inspect.Parameter.KEYWORD_ONLY and params[name].default is None for name in fields)
    seen = {}
    resolve = DecodingConfig.resolve
    monkeypatch.setattr(DecodingConfig, "resolve", lambda self, head, **o: seen.update(o) or resolve(self, head, **o))
    target = tiny_target("llama", vocab_size=96)
    draft = _draft(target, "fixed")
    given = {name: getattr(DecodingConfig(verify_mode="fixed"), name) for name in fields}  # explicit, not None
    ids = torch.tensor([[5, 9, 13, 2, 40]])
    out = target.generate(ids, max_new_tokens=6, do_sample=False, custom_generate=dspark_generate, draft=draft, **given)
    assert out.tolist() == target.generate(ids, max_new_tokens=6, do_sample=False).tolist()
    assert seen == given
