"""Pin the scheduler's measured costs to a file, so benchmarks in separate processes schedule alike.

The scheduler decides from what each process measures: the target's verify profile (cached on disk, but measured
again when the machine's probe drifts) and the draft's drafting costs (measured once per process). On a shared CPU
these move by ±10% between processes, and so do the scheduler's choices and τ. ``pin_costs`` measures them once
and writes them to a JSON file; every later call with that file sets the same numbers instead of measuring, so
runs differ only in what they are asked to compare.

    pin_costs(draft, target, path, max_width=33, tree_top_k=[16])   # one row, float32 or whatever the pair runs in
"""

from __future__ import annotations

import json
from pathlib import Path

from hf_dspark import DSparkDraftModel
from hf_dspark.scheduling.costs import draft_seconds, measured_draft_seconds, sps_profile, tree_draft_seconds
from hf_dspark.scheduling.policy import SPSProfile


def pin_costs(
    draft: DSparkDraftModel, target, path: Path, max_width: int | None = None, tree_top_k: list[int] = ()
) -> dict:
    """Load the costs pinned in ``path`` onto ``draft`` (its ``sps_profile`` and its measured drafting costs for one
    row, greedy, chain and every tree width in the file), or, when ``path`` does not exist, measure them (the verify
    profile out to ``max_width`` slots, the chain's draft block, each ``tree_top_k``'s tree) and write it. -> the
    pinned costs: ``{"sps": {B: steps/s}, "chain_seconds": s, "tree_seconds": {k: s}}``."""
    if path.is_file():
        costs = json.loads(path.read_text())
        missing = [k for k in tree_top_k if str(k) not in costs["tree_seconds"]]
        if missing:
            raise ValueError(f"{path} pins no drafting cost for trees of top-k {missing}: pin them in a new file")
    else:
        profile = sps_profile(draft, target, 1, max_width=max_width)
        costs = {
            "sps": {str(b): s for b, s in profile.table.items()},
            "chain_seconds": draft_seconds(draft, 1),
            "tree_seconds": {str(k): tree_draft_seconds(draft, k) for k in tree_top_k},
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(costs, indent=1))
    draft.sps_profile = SPSProfile.from_table({int(b): s for b, s in costs["sps"].items()})
    table, device = measured_draft_seconds(draft), str(draft.device)
    table[(1, False, device, draft.dtype)] = costs["chain_seconds"]
    for k, seconds in costs["tree_seconds"].items():
        table[("tree", int(k), device, draft.dtype)] = seconds
    return costs
