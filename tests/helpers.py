"""Helpers shared by several test files: exact distributions and chi-square tests for sampling, left-padded batches.

Model builders live in :mod:`hf_dspark.testing`; fixtures in ``conftest.py``.
"""

import torch
from transformers.generation import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import hf_dspark
from hf_dspark.testing import chi_square_pvalue, exact_first_tokens  # noqa: F401 (chi_square_pvalue: re-exported)

# --- sampling: the first tokens of a tiny-vocabulary target, enumerated exactly ---------------------------------

VOCAB = 6
PROMPT = torch.tensor([[1, 4, 2]])
ALPHA = 1e-3
SAMPLES = 1500


def processors(temperature, top_k=None, top_p=None):
    procs = [TemperatureLogitsWarper(temperature)]  # the order transformers builds them in
    if top_k:
        procs.append(TopKLogitsWarper(top_k))
    if top_p:
        procs.append(TopPLogitsWarper(top_p))
    return LogitsProcessorList(procs)


def exact_distribution(target, processors, n_tokens=3):
    """P(x_1..x_n | PROMPT) under the processed target, by enumeration over all prefixes."""
    return exact_first_tokens(target, PROMPT, processors, n_tokens)


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


def noisy_markov_draft(target, seed: int = 1):
    """A fixed-verify Markov draft with random (not neutral) W2, so the head moves the proposals: the draft of the
    chi-square tests, which then exercise rejection sampling at every slot."""
    draft = hf_dspark.DSparkDraftModel.from_target(target, block_size=4, head_type="markov", head_rank=4)
    draft.decoding.verify_mode = "fixed"
    torch.manual_seed(seed)
    with torch.no_grad():
        draft.sequential_head.markov_w2.weight.normal_(0, 2.0)
    return draft


CASES = {
    "temperature": dict(temperature=0.7, top_k=0, top_p=1.0),
    "top-k-top-p": dict(temperature=1.3, top_k=4, top_p=0.8),
    "temperature-top-p": dict(temperature=0.7, top_k=0, top_p=0.9),  # the token-tree issue's sampling setting
}


# --- batches ----------------------------------------------------------------------------------------------------

PAD = 0


def left_pad(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


PROMPTS = [[5, 17, 33, 2, 9, 41, 8], [12, 3], [70, 71, 72, 73, 74], [90, 15, 15, 60]]
