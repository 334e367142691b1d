"""`python -m hf_dspark`: DSpark generation on the embedded default, side by side with plain greedy `generate`.

Prints per-prompt and overall tokens/s, τ and the wall-clock speedup as a user sees them in steady state: the
one-time costs (the scheduler's SPS profile and the draft's cost, measured or loaded from the disk cache, and a
first call of each way to generate) are paid before any timing and reported on their own line.

Both outputs are compared. In float32 they must be identical (a difference is a bug and stops the run).
``--dtype auto`` (the default) picks bfloat16 on CPUs with native bf16 units, where a multi-token verify is as cheap
as one token; there a forward over several tokens rounds differently from a one-token step, so greedy output can
part from plain greedy at a near-tie (as under transformers' own assisted generation). Each such line says where
and why: the token, both candidates and their logits in the target's dtype and in float32, judged by the rule
`hf-dspark bench` applies (:mod:`hf_dspark.evaluation.ties`); a difference that is not a tie stops the run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from . import embedded
from .cli_arguments import add_decoding_flags, decoding_overrides, positive_int
from .decoding.costs import CACHE_DIR
from .evaluation.bench import warm_up
from .evaluation.evaluate import chat_ids
from .evaluation.ties import first_divergence, upcast_copy
from .integration.generate import dspark_generate
from .model.modeling_dspark import DSparkDraftModel

SAMPLE_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Please reason step by step.",
    "Write a Python function `is_palindrome(s: str) -> bool` that ignores case and spaces.",
]


def _prompts(path: str | None, limit: int) -> list[str]:
    if path is None:
        return SAMPLE_PROMPTS[:limit]
    lines = [json.loads(line) for line in Path(path).read_text().split("\n") if line.strip()]
    return [row["turns"][0] for row in lines[:limit]]


def existing_file(value: str) -> str:
    if not Path(value).is_file():
        raise argparse.ArgumentTypeError(f"{value}: no such file")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The main command's options, each refusing a value it cannot use before anything loads."""
    ap = argparse.ArgumentParser(prog="python -m hf_dspark", description=__doc__)
    ap.add_argument("--prompts", type=existing_file,
                    help="a {'turns': [...]} JSONL file (default: three built-in prompts)")  # fmt: skip
    ap.add_argument("--limit", type=positive_int, default=3, help="prompts run")
    ap.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens generated per prompt")
    ap.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="auto: bfloat16 where the CPU has native bf16 units, else float32")  # fmt: skip
    add_decoding_flags(ap, aliases={"lookup_max_ngram": ["--lookup"]})  # --lookup N: lookup drafting, N-grams down
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    given = decoding_overrides(args)  # this run's decoding settings, checked before anything loads
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = embedded.fast_dtype() if args.dtype == "auto" else getattr(torch, args.dtype)
    exact = dtype == torch.float32

    if embedded.has_shipped_draft():
        target, tokenizer, draft = embedded.load(dtype)
        print(f"target: SmolLM2-135M-Instruct (GGUF, {str(dtype)[6:]}); draft: {embedded.DRAFT_DIR.name}")
    else:
        target, tokenizer = embedded.load_target(dtype)
        torch.manual_seed(0)
        draft = DSparkDraftModel.from_target(target, block_size=8)
        print(
            "NOTE: no trained draft ships with this copy of hf-dspark yet, so this run uses an UNTRAINED draft.\n"
            "      Its output is still exactly the target's (DSpark is lossless), but expect a slowdown, not a speedup."
        )

    if given.get("lookup_max_ngram") and "lookup_min_ngram" not in given:  # --lookup 1: 1-grams
        given["lookup_min_ngram"] = min(draft.decoding.lookup_min_ngram, given["lookup_max_ngram"])
    settings = draft.decoding.replace(**given)  # this run's own: the draft's config is left as it is
    lookup = settings.lookup_max_ngram
    longest = settings.lookup_max_tokens or draft.config.num_draft_tokens
    grows = " (growing from γ while lookups are accepted in full)" if settings.lookup_adaptive else ""
    print(f"lookup drafting: n-grams of {lookup} to {settings.lookup_min_ngram} tokens, continued up to {longest}"
          f"{grows}" if lookup else "lookup drafting: off")  # fmt: skip
    prompts = [chat_ids(tokenizer, text) for text in _prompts(args.prompts, args.limit)]
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    how, profile_s, first_s = warm_up(target, draft, prompts[0])
    print(
        f"one-time costs, paid before timing: SPS profile and draft cost {how} in {profile_s:.1f} s (cached in "
        f"{CACHE_DIR}), first calls {first_s:.1f} s"
    )
    total = {"plain": 0.0, "dspark": 0.0, "tokens": 0, "rounds": 0, "committed": 0, "identical": 0, "looked_up": 0}
    exact_copy = None  # the target's weights in float32, made on the first difference only
    for i, ids in enumerate(prompts):
        t0 = time.perf_counter()
        ref = target.generate(ids, **kw)
        t1 = time.perf_counter()
        out = target.generate(ids, custom_generate=dspark_generate, draft=draft, **given, **kw)
        t2 = time.perf_counter()
        same = out.tolist() == ref.tolist()
        n = ref.shape[1] - ids.shape[1]
        total["identical"] += same
        total["plain"] += t1 - t0
        total["dspark"] += t2 - t1
        total["tokens"] += n
        total["rounds"] += draft.stats.rounds
        total["committed"] += sum(draft.stats.committed)
        total["looked_up"] += sum(draft.stats.looked_up)
        print(
            f"[{i}] {n} tokens  plain {n / (t1 - t0):6.1f} tok/s  dspark {n / (t2 - t1):6.1f} tok/s  "
            f"tau {draft.stats.tau:4.2f}  speedup {(t1 - t0) / (t2 - t1):4.2f}x  identical={same}"
        )
        if not same:
            if exact_copy is None and not exact:
                exact_copy = upcast_copy(target)
            found = first_divergence(target, out, ref, exact_copy, prompt_len=ids.shape[1])
            print(f"    {found.describe(tokenizer)}")
            if exact or not found.tie:
                raise SystemExit("DSpark output differs from plain greedy output: this is a bug, please report it.")
    tau = total["committed"] / max(total["rounds"], 1)
    print(
        f"overall: plain {total['tokens'] / total['plain']:.1f} tok/s, dspark {total['tokens'] / total['dspark']:.1f} "
        f"tok/s, tau {tau:.2f}, speedup {total['plain'] / total['dspark']:.2f}x, "
        f"{total['identical']}/{i + 1} outputs identical to plain greedy"
        + (f", {total['looked_up']}/{total['rounds']} rounds looked up" if lookup else "")
    )
    if not exact and total["identical"] <= i:
        print(
            f"({str(dtype)[6:]}: a multi-token verify rounds differently from a one-token step, so greedy output can "
            "part at a near-tie, as explained above; --dtype float32 gives bit-identical output, at a slowdown on "
            "this kind of CPU)"
        )


if __name__ == "__main__":
    main()
