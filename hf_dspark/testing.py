"""Small models and tokenizers for tests and examples: built from configs in a second, no download.

    tiny_target     a randomly initialised Llama or Qwen3 causal LM (sharpened logits)
    tiny_rows       training rows whose answers are that target's own greedy continuations
    char_tokenizer  a character-level tokenizer with a chat template
    exact_first_tokens, chi_square_pvalue
                    the exact distribution of a small-vocabulary target's first tokens, by enumeration, and the
                    chi-square test of sampled counts against it (needs scipy)

The project's test suite and its helper scripts build everything from these; so can users testing their own code
around ``generate(assistant_model=draft)`` without a Hub connection.
"""

from __future__ import annotations

import itertools

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM


def tiny_target(arch: str = "llama", vocab_size: int = 96, dtype=torch.float32, seed: int = 0, layers: int = 4, **kw):
    """A tiny randomly initialised causal LM; ``arch`` is "llama" or "qwen3"."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    common.update(kw)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=8, **common))
    else:
        raise ValueError(f"arch must be 'llama' or 'qwen3', got {arch!r}")
    # Sharper logits than the default init, so greedy paths are not decided by float noise.
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    return model.to(dtype).eval()


def tiny_rows(target, n: int = 12, new_tokens: int = 30) -> list[dict]:
    """Training rows whose answers are the tiny target's own greedy continuations of random 6-token prompts."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        ids = target.generate(torch.randint(3, 96, (1, 6), generator=g), max_new_tokens=new_tokens, do_sample=False)[0]
        rows.append({"id": str(i), "prompt_ids": ids[:6].tolist(), "response_ids": ids[6:].tolist()})
    return rows


def char_tokenizer():
    """A tiny character-level tokenizer (ids 3..93 for printable characters) with a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 32 + 90)] + ["\n"]
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join without spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'][:40] }}\n{% endfor %}a:"
    return fast


@torch.no_grad()
def exact_first_tokens(target, prompt: torch.Tensor, processors, n_tokens: int = 3) -> dict[tuple[int, ...], float]:
    """P(x_1..x_n | prompt [1, P]) under the target's logits after ``processors`` (a LogitsProcessorList), for
    every sequence of ``n_tokens`` ids, by enumeration: V^n target forwards, so only for tiny vocabularies."""
    vocab = target.config.get_text_config().vocab_size
    start = prompt.shape[1]
    probs = {}
    for seq in itertools.product(range(vocab), repeat=n_tokens):
        ids = torch.cat([prompt, torch.tensor([seq])], dim=1)
        logits = target(ids).logits[0, start - 1 : -1].double()
        p = 1.0
        for i, tok in enumerate(seq):
            scores = processors(ids[:, : start + i], logits[i : i + 1])
            p *= torch.softmax(scores, -1)[0, tok].item()
        probs[seq] = p
    return probs


def chi_square_pvalue(counts: dict[tuple[int, ...], int], probs: dict[tuple[int, ...], float]) -> float:
    """Chi-square goodness-of-fit p-value of sampled ``counts`` against ``probs`` (:func:`exact_first_tokens`);
    cells expected fewer than 5 times are pooled. A sequence of probability zero raises ``AssertionError``."""
    from scipy.stats import chisquare

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
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)
