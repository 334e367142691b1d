"""``target.generate(custom_generate=hf_dspark.dspark_generate, draft=draft)``: transformers' public extension point,
with hf-dspark's ``assistant_model`` patch switched off, so nothing but the public route is exercised."""

import pytest
import torch
from conftest import tiny_target
from test_sampling import ALPHA, CASES, _processors, chi_square_pvalue, exact_distribution, sample_counts
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import hf_dspark
from hf_dspark import DSparkDraftModel, dspark_generate
from hf_dspark.scheduler import SPSProfile
from hf_dspark.versions import CACHE_FIELD


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
    draft.config.verify_mode = mode
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
    out = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0,
                          custom_generate=dspark_generate, draft=draft)  # fmt: skip
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

    kw = dict(max_new_tokens=20, do_sample=False, return_dict_in_generate=True, output_scores=True,
              stopping_criteria=StoppingCriteriaList([StopAfter()]))  # fmt: skip
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
    out = target.generate(ids, max_new_tokens=18, do_sample=False, streamer=streamer,
                          custom_generate=dspark_generate, draft=draft)  # fmt: skip
    assert out.tolist() == ref.tolist()
    assert streamer.puts[0] == ids[0].tolist() and streamer.ended
    assert [t for put in streamer.puts[1:] for t in put] == ref[0, 4:].tolist()
    assert len(streamer.puts) - 1 < 18  # several tokens per round, not one put per token


def test_sampling_matches_target_distribution_without_the_patch():
    from test_sampling import VOCAB

    kw = CASES["top-k-top-p"]
    target = tiny_target("llama", vocab_size=VOCAB, dtype=torch.float64, seed=3, tie_word_embeddings=False)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="markov", head_rank=4)
    draft.config.verify_mode = "fixed"
    torch.manual_seed(1)
    with torch.no_grad():
        draft.sequential_head.markov_w2.weight.normal_(0, 2.0)
    probs = exact_distribution(target, _processors(kw["temperature"], kw["top_k"], kw["top_p"]))
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
        target.generate(ids, max_new_tokens=4, do_sample=True, num_return_sequences=2,
                        custom_generate=dspark_generate, draft=draft)  # fmt: skip
    with pytest.raises(ValueError, match="not used by the model"):
        target.generate(ids, max_new_tokens=4, custom_generate=dspark_generate, draft=draft, verify_modee="x")
