"""float16 targets: DSpark decoding runs, greedy output equals plain greedy's (or parts only at a near-tie, the rule
bfloat16 has), and sampling follows the target's exact distribution.

float16 is the dtype most GPU users load in. Its largest finite value is 65,504, so anything that sums a row of
logits in float16 overflows on a real vocabulary (SmolLM2: logits up to ~38, a row sums to ~455,000).
"""

import pytest
import torch
from helpers import (
    ALPHA,
    CASES,
    VOCAB,
    chi_square_pvalue,
    exact_distribution,
    noisy_markov_draft,
    processors,
    sample_counts,
)

from hf_dspark import DSparkDraftModel
from hf_dspark.decoding.checks import check_finite
from hf_dspark.evaluation.ties import first_divergence, upcast_copy
from hf_dspark.testing import tiny_target


def test_finite_check_sums_float16_logits_in_float32():
    """A float16 row whose float16 sum overflows is finite, and passes; one inf or NaN is still refused."""
    logits = torch.full((2, 3, 49152), 38.0, dtype=torch.float16)
    assert torch.isinf(logits.sum(-1)).all()  # what the check summed before: every float16 row refused
    check_finite(logits)
    check_finite(logits, torch.tensor([[True, False, True], [True, True, True]]))
    for bad in (float("inf"), float("nan")):
        broken = logits.clone()
        broken[1, 2, 7] = bad
        with pytest.raises(ValueError, match="non-finite logits"):
            check_finite(broken)
        check_finite(broken, torch.tensor([[True, True, True], [True, True, False]]))  # a padded slot: not read


def _greedy_agrees(target, ids, out, ref) -> bool:
    """Token for token plain greedy's, or parted at a near-tie by the rule the bench and the demo apply."""
    if torch.equal(out, ref):
        return True
    found = first_divergence(target, out, ref, upcast_copy(target), prompt_len=ids.shape[1])
    return found is not None and found.tie


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("head", ["none", "markov"])
@pytest.mark.parametrize("route", ["assistant_model", "custom_generate"])
def test_float16_greedy_equals_plain_greedy_on_the_tiny_families(arch, head, route):
    import hf_dspark

    target = tiny_target(arch, dtype=torch.float16)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type=head, head_rank=8)
    kw = {"assistant_model": draft} if route == "assistant_model" else {
        "custom_generate": hf_dspark.dspark_generate, "draft": draft}  # fmt: skip
    identical = 0
    for seed in range(3):
        ids = torch.randint(3, 96, (1, 5 + 3 * seed), generator=torch.Generator().manual_seed(seed))
        ref = target.generate(ids, max_new_tokens=24, do_sample=False)
        out = target.generate(ids, max_new_tokens=24, do_sample=False, **kw)
        assert draft.dtype == torch.float16 and out.shape == ref.shape
        assert _greedy_agrees(target, ids, out, ref), (out.tolist(), ref.tolist())
        identical += torch.equal(out, ref)
    assert identical >= 2  # ties are rare with these sharpened logits: most outputs are the same tokens


def test_float16_batch_with_left_padding_equals_plain_greedy_per_row():
    from helpers import PROMPTS, left_pad

    target = tiny_target("llama", dtype=torch.float16)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="markov", head_rank=8)
    ids, mask = left_pad(PROMPTS)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, assistant_model=draft)
    for r, prompt in enumerate(PROMPTS):
        one = torch.tensor([prompt])
        ref = target.generate(one, max_new_tokens=16, do_sample=False)
        mine = out[r : r + 1, ids.shape[1] - len(prompt) :]
        assert _greedy_agrees(target, one, mine, ref), r


def test_float16_sampling_matches_the_target_distribution():
    """Rejection sampling in a float16 target: the acceptance ratios are computed in float32 from float16 logits;
    the first three tokens follow the target's exact (processed) distribution (chi-square at α = 1e-3)."""
    torch.set_num_threads(1)
    target = tiny_target("llama", vocab_size=VOCAB, dtype=torch.float16, seed=3, tie_word_embeddings=False)
    kw = CASES["top-k-top-p"]
    draft = noisy_markov_draft(target)
    probs = exact_distribution(target, processors(kw["temperature"], kw["top_k"], kw["top_p"]))
    counts = sample_counts(target, draft, kw, n=1000)
    assert chi_square_pvalue(counts, probs) > ALPHA
    assert 0 < draft.seen["accepted"] < draft.seen["proposed"]


def test_float16_embedded_target_with_the_shipped_draft(smollm2):
    """The issue's case: SmolLM2 moved to float16, then DSpark generation (it was refused as non-finite)."""
    import copy

    from hf_dspark.embedded import DRAFT_DIR

    target, tokenizer = smollm2
    half = torch.nn.Module.to(copy.deepcopy(target), torch.float16)
    draft = DSparkDraftModel.from_pretrained(DRAFT_DIR, dtype=torch.float16).attach(half)
    for text in ("Write a Python function that checks whether a number is prime.", "What is 17 times 23?"):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt")["input_ids"]  # fmt: skip
        ref = half.generate(ids, max_new_tokens=24, do_sample=False)
        out = half.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=draft)
        assert _greedy_agrees(half, ids, out, ref), tokenizer.decode(out[0, ids.shape[1] :])
        assert sum(draft.stats.accepted) > 0  # the draft was used, not bypassed
