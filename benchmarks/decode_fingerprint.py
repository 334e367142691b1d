"""What every decoding route does, as data, so that two commits can be compared round for round.

    python -m benchmarks.decode_fingerprint --out FILE.json [--compact]

A tiny random Llama target (float64) and a random DSpark draft, a batch of two prompts, every verify mode × chain
and 3-wide tree × lookup off and on × greedy and seeded sampling (temperature 0.9, top-k 20), 24 new tokens. The
scheduler's costs are pinned (a verify profile and constant drafting seconds), and the wall-time recalibration is
off, so nothing read from a clock decides anything: two runs of one commit write the same file. ``--compact``: EOS
tokens end rows early and no dict output is asked for, so finished rows leave the batch (``compact``) as they do
by default. Writes, per configuration, the sequences and each round's proposed, accepted and verified sizes; run it
on each commit (a ``git worktree`` of the older one, ``PYTHONPATH`` pointing at it) and compare the files.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hf_dspark import DSparkDraftModel, dspark_generate
from hf_dspark.decoding import costs, tree_rounds
from hf_dspark.scheduling.modes import MODES
from hf_dspark.scheduling.policy import SPSProfile
from hf_dspark.testing import tiny_target

PROMPTS = torch.tensor([[5, 17, 33, 2, 9, 5, 17, 33], [7, 8, 9, 10, 11, 12, 13, 14]])
EOS = [40, 41, 42, 43, 44]  # with --compact: tokens this target draws now and then, ending rows early


def pin_costs() -> None:
    """Constant drafting costs, as the measured ones would be read (the verify profile is the draft's own)."""
    costs.draft_seconds = lambda *args, **kwargs: 0.004
    tree_rounds.tree_draft_seconds = lambda draft, top_k, rows=1: 0.003 + 0.001 * top_k


def fingerprint(compact: bool) -> dict:
    """-> {"<mode> k<top-k> l<lookup n-gram> s<sampled>": [sequences, proposed, accepted, verify_rounds]}."""
    pin_costs()
    target = tiny_target("llama", dtype=torch.float64)
    torch.manual_seed(0)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="markov", head_rank=8)
    draft.sps_profile = SPSProfile.from_callable(lambda B: 1.0 / (1.0 + 0.05 * B))
    out = {}
    for mode in MODES:
        for top_k in (1, 3):
            for lookup in (0, 2):
                for sample in (False, True):
                    torch.manual_seed(1)
                    kw = dict(do_sample=True, temperature=0.9, top_k=20) if sample else dict(do_sample=False)
                    kw |= dict(eos_token_id=EOS) if compact else dict(return_dict_in_generate=True)
                    result = target.generate(
                        PROMPTS, custom_generate=dspark_generate, draft=draft, max_new_tokens=24, pad_token_id=0,
                        verify_mode=mode, tree_top_k=top_k, lookup_max_ngram=lookup, cost_recalibration=False, **kw,
                    )  # fmt: skip
                    sequences = result if compact else result.sequences
                    stats = draft.stats if compact else result.dspark_stats
                    key = f"{mode} k{top_k} l{lookup} s{int(sample)}"
                    out[key] = [sequences.tolist(), stats.proposed, stats.accepted, stats.verify_rounds]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--compact", action="store_true", help="rows end at EOS and leave the batch")
    args = ap.parse_args()
    result = fingerprint(args.compact)
    args.out.write_text(json.dumps(result))
    print(f"{len(result)} configurations -> {args.out}")


if __name__ == "__main__":
    main()
