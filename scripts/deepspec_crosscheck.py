"""Cross-check our DeepSpec loader and decoding loop against DeepSpec's own code (deepseek-ai/DeepSpec).

    PYTHONPATH=.venv/transformers-5.17 python -m scripts.deepspec_crosscheck --deepspec PATH_TO_DEEPSPEC \
        [--out benchmarks/results/deepspec_crosscheck.json]        # or DEEPSPEC_SRC=PATH instead of --deepspec

Run it under transformers 5.17 (the copy ``scripts/test.sh`` installs in ``.venv/transformers-5.17``): DeepSpec
pins 5.10.2, and its loops cut their caches with ``DynamicCache.crop(length)``, the absolute form that transformers
5.18 removed; 5.17, the oldest release this package supports, still accepts it (with a deprecation warning).

PATH is a checkout of DeepSpec (the folder holding its ``deepspec`` package); nothing of it is copied here, it is
imported from there. For each variant (vanilla, gated and RNN Markov heads; confidence head reading the Markov
feature, reading h_k alone, or absent; no Markov head) the script

1. builds a small random draft in DeepSpec's classes (``build_draft_config`` + ``Qwen3DSparkModel``) for a tiny
   random Qwen3 target, with the target's embedding and LM head copied in as DeepSpec's trainer does, every other
   tensor perturbed so nothing sits at an initial zero;
2. saves it as DeepSpec's checkpoint manager does (``save_pretrained``) and loads it with
   ``DSparkDraftModel.from_pretrained`` (our DeepSpec loader);
3. compares one block drafted from a prompt's context: base logits (DeepSpec's ``forward_dspark_draft_block`` +
   ``compute_logits``), the sequential head's bias (``sample_draft_tokens``) and the confidence logits
   (``_predict_confidence_logits``), against ours, in float32;
4. decodes greedily with DeepSpec's evaluator loop (``Qwen3DSparkEvaluator.generate_one_sample``: full-block
   proposals, its ``verify_draft_tokens``) and with ours (fixed full-block verify), comparing tokens and the
   accepted drafts of every round before our last (at the length limit we verify only what fits, where DeepSpec
   proposes whole blocks until it has passed the limit, sometimes one round more, and trims the output).

Runs on CPU (DeepSpec's evaluator uses SDPA attention; nothing CUDA-only is on these paths). Writes a JSON report.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers

from hf_dspark import DSparkDraftModel, dspark_generate
from hf_dspark.testing import tiny_target

ROOT = Path(__file__).resolve().parents[1]

VOCAB, MASK, BLOCK, RANK, NEW_TOKENS = 12, 11, 4, 8, 48
# (name, markov_head_type or None, confidence head: None | "markov" | "hidden")
VARIANTS = [
    ("vanilla+conf(markov)", "vanilla", "markov"),
    ("gated+conf(markov)", "gated", "markov"),
    ("rnn+conf(markov)", "rnn", "markov"),
    ("vanilla+conf(hidden)", "vanilla", "hidden"),
    ("vanilla, no confidence", "vanilla", None),
    ("no markov+conf(hidden)", None, "hidden"),
]


class ModelArgs(dict):
    """DeepSpec's config builder reads its arguments both as ``"key" in args`` and as ``args.key``."""

    __getattr__ = dict.__getitem__


def import_deepspec(path: Path):
    if not (path / "deepspec" / "modeling" / "dspark" / "qwen3" / "modeling.py").is_file():
        raise SystemExit(f"{path} is not a DeepSpec checkout (no deepspec/modeling/dspark/qwen3/modeling.py in it)")
    sys.path.insert(0, str(path))  # DeepSpec is a checkout, not a package: the one foreign tree imported by path
    from deepspec.eval.dspark import draft_ops
    from deepspec.eval.dspark.evaluator import Qwen3DSparkEvaluator
    from deepspec.modeling.dspark.common import extract_context_feature
    from deepspec.modeling.dspark.qwen3 import Qwen3DSparkModel
    from deepspec.modeling.dspark.qwen3.config import build_draft_config

    return SimpleNamespace(draft_ops=draft_ops, Evaluator=Qwen3DSparkEvaluator, features=extract_context_feature,
                           Model=Qwen3DSparkModel, build_config=build_draft_config)  # fmt: skip


def their_draft(ds, target, markov: str | None, confidence: str | None, seed: int):
    args = ModelArgs(num_draft_layers=2, target_layer_ids=[0, 2], confidence_head_alpha=1.0 if confidence else 0.0,
                     confidence_head_with_markov=confidence == "markov", markov_rank=RANK if markov else 0,
                     markov_head_type=markov or "vanilla", block_size=BLOCK, mask_token_id=MASK,
                     num_anchors=16)  # fmt: skip
    config = ds.build_config(target.config, args)
    config._attn_implementation = "sdpa"  # what DeepSpec's evaluator runs (training uses flex attention)
    torch.manual_seed(seed)
    model = ds.Model(config).eval()
    model.initialize_embeddings_and_head(embed_tokens=target.model.embed_tokens, lm_head=target.lm_head)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith(("embed_tokens", "lm_head")):
                p.add_(torch.randn_like(p) * 0.2)
    return model


@torch.no_grad()
def compare_block(ds, theirs, ours, target, prompt) -> dict:
    """One block from the prompt's context: base logits, the head's bias and the confidence logits, both ways."""
    from transformers import DynamicCache

    L = prompt.shape[1]
    hidden = target(prompt, output_hidden_states=True).hidden_states
    context = ds.features(hidden, theirs.target_layer_ids)
    block_ids = torch.full((1, BLOCK), MASK)
    block_ids[0, 0] = prompt[0, -1]
    positions = torch.arange(L + BLOCK)[None]
    h_theirs = ds.draft_ops.forward_dspark_draft_block(theirs, draft_input_ids=block_ids, position_ids=positions,
                                                       past_key_values_draft=DynamicCache(),
                                                       target_hidden_states=context[:, : L - 1], start=L - 1,
                                                       block_size=BLOCK)  # fmt: skip
    # DeepSpec's block starts at the anchor's position: the context is the L - 1 positions before it
    h_theirs = h_theirs[:, :BLOCK]
    base_theirs = theirs.compute_logits(h_theirs)
    tokens, step_theirs = theirs.sample_draft_tokens(base_theirs, first_prev_token_ids=block_ids[:, 0], temperature=0.0,
                                                     hidden_states=h_theirs)  # fmt: skip
    conf_theirs = ds.draft_ops._predict_confidence_logits(theirs, proposal_hidden_states=h_theirs,
                                                          draft_input_ids=block_ids, sampled_tokens=tokens,
                                                          block_size=BLOCK)  # fmt: skip

    kv = ours.context_key_values(context[:, : L - 1], torch.arange(L - 1)[None])
    out = ours(ours.embed_block(block_ids[:, 0]), torch.arange(L - 1, L - 1 + BLOCK)[None], kv)
    prev = torch.cat([block_ids[:, :1], tokens[:, :-1]], dim=1)
    bias, feature = (None, None)
    if ours.sequential_head is not None:
        bias, feature = ours.sequential_head.teacher_forced(prev, out.hidden_states)
    conf_ours = None if ours.confidence is None else ours.confidence.logit(out.hidden_states, feature)
    diff = lambda a, b: float((a - b).abs().max())  # noqa: E731
    result = {"base_logits_max_abs_diff": diff(out.logits, base_theirs)}
    result["head_bias_max_abs_diff"] = None if bias is None else diff(bias, step_theirs - base_theirs)
    result["confidence_logit_max_abs_diff"] = None if conf_ours is None else diff(conf_ours, conf_theirs)
    result["same_greedy_block"] = bool(torch.equal((out.logits + (0 if bias is None else bias)).argmax(-1), tokens))
    return result


@torch.no_grad()
def compare_decoding(ds, theirs, ours, target, prompt) -> dict:
    evaluator = object.__new__(ds.Evaluator)  # its loop without its distributed set-up and dataset plumbing
    evaluator.target_model, evaluator.draft_model, evaluator.confidence_head_recorder = target, theirs, None
    evaluator.args = SimpleNamespace(max_new_tokens=NEW_TOKENS, temperature=0.0, confidence_threshold=0.0)
    sample = evaluator.generate_one_sample(input_ids=prompt, stop_token_ids=None)
    ours.decoding.verify_mode = "fixed"
    out = target.generate(prompt, custom_generate=dspark_generate, draft=ours, max_new_tokens=NEW_TOKENS,
                          do_sample=False)  # fmt: skip
    theirs_counts, ours_counts = list(sample.accepted_draft_lengths), list(ours.stats.accepted)
    return {
        "identical_tokens": out[0].tolist() == sample.output_ids[0].tolist(),
        # our last round verifies only what fits the length limit; DeepSpec's loop runs until it has passed the
        # limit (it may take one more round) and trims the output afterwards: rounds before our last must agree
        "identical_accepted_counts": ours_counts[:-1] == theirs_counts[: len(ours_counts) - 1],
        "rounds": len(ours_counts), "accepted_drafts": sum(ours_counts),
        "deepspec_accepted": theirs_counts, "ours_accepted": ours_counts,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deepspec", type=Path, default=os.environ.get("DEEPSPEC_SRC"),
                    help="a DeepSpec checkout (default: $DEEPSPEC_SRC)")  # fmt: skip
    ap.add_argument("--deepspec-commit", help="the checkout's commit, recorded in the report (default: git rev-parse)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "deepspec_crosscheck.json")
    args = ap.parse_args(argv)
    if args.deepspec is None:
        raise SystemExit(
            "name DeepSpec's source: --deepspec PATH or DEEPSPEC_SRC=PATH (a checkout of deepseek-ai/DeepSpec)"
        )
    if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 18):
        raise SystemExit(f"transformers {transformers.__version__}: DeepSpec's loops need DynamicCache.crop(length), "
                         "removed in 5.18; run under 5.17: PYTHONPATH=.venv/transformers-5.17 python ...")  # fmt: skip
    ds = import_deepspec(args.deepspec.resolve())
    target = tiny_target("qwen3", vocab_size=VOCAB, layers=4, tie_word_embeddings=False)
    prompt = torch.randint(1, MASK, (1, 12), generator=torch.Generator().manual_seed(1))
    rows = []
    for seed, (name, markov, confidence) in enumerate(VARIANTS):
        theirs = their_draft(ds, target, markov, confidence, seed)
        with tempfile.TemporaryDirectory() as tmp:
            theirs.save_pretrained(tmp)
            ours = DSparkDraftModel.from_pretrained(tmp).attach(target)
        row = {"variant": name, "loaded_head_type": ours.config.head_type,
               "confidence_head": ours.confidence is not None}  # fmt: skip
        row |= compare_block(ds, theirs, ours, target, prompt)
        row |= compare_decoding(ds, theirs, ours, target, prompt)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_accepted")}), flush=True)
    tol = 1e-4
    ok = all(
        r["base_logits_max_abs_diff"] < tol and (r["head_bias_max_abs_diff"] or 0) < tol
        and (r["confidence_logit_max_abs_diff"] or 0) < tol and r["identical_tokens"] and r["identical_accepted_counts"]
        for r in rows
    )  # fmt: skip
    commit = args.deepspec_commit or (
        (args.deepspec / ".git").exists() and os.popen(f"git -C {args.deepspec} rev-parse HEAD").read().strip()
    )
    report = {
        "ok": ok, "tolerance": tol, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
        "transformers": transformers.__version__, "device": f"cpu ({platform.machine()})",
        "deepspec_commit": commit or None, "variants": rows,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'OK' if ok else 'DIFFERS'}: {len(rows)} variants -> {args.out}")
    return report


if __name__ == "__main__":
    main()
