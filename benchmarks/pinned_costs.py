"""Pin the scheduler's measured costs to a file, so benchmarks in separate processes schedule alike.

The scheduler decides from what each process measures: the target's verify profile (cached on disk, but measured
again when the machine's probe drifts) and the draft's drafting costs (measured once per process). On a shared CPU
these move by ±10% between processes, and so do the scheduler's choices and τ. ``pin_costs`` measures them once
and writes them to a JSON file; every later call with that file sets the same numbers instead of measuring, so
runs differ only in what they are asked to compare.

    pin_costs(draft, target, path, max_width=33, tree_top_k=[16])   # one row, in the dtype the pair runs in

A file holds the costs of one dtype and device (recorded in it); loading it onto a pair that runs in another is
refused, since bfloat16 and float32 steps cost very differently on a CPU with bf16 units.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from hf_dspark import DSparkDraftModel
from hf_dspark.decoding.costs import draft_seconds, measured_draft_seconds, sps_profile, tree_draft_seconds
from hf_dspark.scheduling.policy import SPSProfile


def pin_costs(
    draft: DSparkDraftModel, target, path: Path, max_width: int | None = None, tree_top_k: list[int] = ()
) -> dict:
    """Load the costs pinned in ``path`` onto ``draft`` (its ``sps_profile`` and its measured drafting costs for one
    row, greedy, chain and every tree width in the file), or, when ``path`` does not exist, measure them (the verify
    profile out to ``max_width`` slots, the chain's draft block, each ``tree_top_k``'s tree and, with any tree, the
    narrowed chain's, a tree of top-k 1, which scheduled trees price narrowing with) and write it. -> the
    pinned costs: ``{"dtype": name, "device": name, "sps": {B: steps/s}, "chain_seconds": s, "tree_seconds": {k: s}}``.
    """
    device, dtype = str(draft.device), str(draft.dtype).removeprefix("torch.")
    if path.is_file():
        costs = json.loads(path.read_text())
        pinned_for = (costs.get("dtype"), costs.get("device"))
        if pinned_for != (dtype, device):
            raise ValueError(
                f"{path} pins costs measured in dtype {pinned_for[0]} on device {pinned_for[1]}, but the draft runs "
                f"in {dtype} on {device}: pin them in a new file"
            )
        missing = [k for k in tree_top_k if str(k) not in costs["tree_seconds"]]
        if missing:
            raise ValueError(f"{path} pins no drafting cost for trees of top-k {missing}: pin them in a new file")
        if tree_top_k and "1" not in costs["tree_seconds"]:
            warnings.warn(
                f"{path} pins no drafting cost for the narrowed chain (a tree of top-k 1, which scheduled trees price "
                "their narrowing with): this process measures it, so trees may schedule differently between runs; "
                "pin the costs in a new file",
                stacklevel=2,
            )
    else:
        profile = sps_profile(draft, target, 1, max_width=max_width)
        # with any tree, the narrowed chain's (top-k 1) too: scheduled trees price narrowing to the chain with it
        widths = sorted({1, *tree_top_k}) if tree_top_k else []
        costs = {
            "dtype": dtype,
            "device": device,
            "sps": {str(b): s for b, s in profile.table.items()},
            "chain_seconds": draft_seconds(draft, 1),
            "tree_seconds": {str(k): tree_draft_seconds(draft, k) for k in widths},
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(costs, indent=1))
    draft.sps_profile = SPSProfile.from_table({int(b): s for b, s in costs["sps"].items()})
    table = measured_draft_seconds(draft)
    table[(1, False, device, draft.dtype)] = costs["chain_seconds"]
    for k, seconds in costs["tree_seconds"].items():
        table[("tree", int(k), 1, device, draft.dtype)] = seconds
    return costs
