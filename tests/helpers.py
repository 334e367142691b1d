"""Helpers shared by several test files: exact distributions and chi-square tests for sampling, left-padded batches.

Model builders live in :mod:`hf_dspark.testing`; fixtures in ``conftest.py``.
"""

import itertools

import torch
from scipy.stats import chisquare
from transformers.generation import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import hf_dspark

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


# --- batches ----------------------------------------------------------------------------------------------------

PAD = 0


def left_pad(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


PROMPTS = [[5, 17, 33, 2, 9, 41, 8], [12, 3], [70, 71, 72, 73, 74], [90, 15, 15, 60]]
