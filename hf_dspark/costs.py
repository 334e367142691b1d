"""What the scheduler prices a round with: the target's verify profile and the draft block's own cost.

    sps_profile     the target's steps per second for each verify shape of a batch (measured once, cached on disk)
    draft_seconds   what one whole draft block costs for a batch (measured once per process)
    round_prices    both, and the planner's profile: the verify profile with the draft block's cost added
    measure_sps     pay both ahead of the first ``generate`` call

Measurements are remembered per draft in weak-keyed tables (a draft that is freed takes its entries with it); a
profile the user sets (``draft.sps_profile``) replaces the measured verify profiles.
"""

from __future__ import annotations

import statistics
import time
import weakref

import torch
from transformers.generation import LogitsProcessorList

from .drafting import DraftContext, draft_block
from .modeling_dspark import DSparkDraftModel
from .scheduler import SPSProfile

# draft -> {(target id, dtype, device, rows): (weak reference to the target, profile)}
_MEASURED_SPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# draft -> {(rows, do_sample, device, dtype): seconds of one draft block}
_MEASURED_DRAFT_SECONDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def measured_sps(draft: DSparkDraftModel) -> dict:
    """The verify profiles measured for ``draft`` so far (see ``_MEASURED_SPS`` for the keys)."""
    return _MEASURED_SPS.setdefault(draft, {})


def measured_draft_seconds(draft: DSparkDraftModel) -> dict:
    """The draft-block costs measured for ``draft`` so far (see ``_MEASURED_DRAFT_SECONDS`` for the keys)."""
    return _MEASURED_DRAFT_SECONDS.setdefault(draft, {})


def sps_profile(draft: DSparkDraftModel, target, rows: int, max_width: int | None = None) -> SPSProfile:
    """``draft.sps_profile`` if set; else the target's profile for a batch of ``rows``, measured on the shapes the
    loop verifies ([rows, 1 + ℓ] blocks, ℓ = 0..num_draft_tokens; one row's token trees up to ``max_width`` slots,
    every 4 slots past the block) once per (target, dtype, device, rows, widths) and cached on disk."""
    if getattr(draft, "sps_profile", None) is not None:
        return draft.sps_profile
    table = measured_sps(draft)
    widths = list(range(1, draft.config.num_draft_tokens + 2))
    if max_width is not None and max_width > widths[-1]:
        widths += [*range(widths[-1] + 4, max_width, 4), max_width]
    key = (id(target), target.dtype, str(target.device), widths[-1], rows)
    owner, profile = table.get(key, (None, None))
    if owner is None or owner() is not target:  # a weak reference: a new target at a freed one's address re-measures
        grid = [rows * width for width in widths]
        profile = SPSProfile.measure(target, grid=grid, rows=rows)
        table[key] = (weakref.ref(target), profile)
    return profile


@torch.no_grad()
def draft_seconds(
    draft: DSparkDraftModel, rows: int, do_sample: bool = False, context: int = 256, reps: int = 3
) -> float:
    """Seconds one whole draft block (backbone + every head slot) costs for ``rows`` rows after a ``context``-slot
    draft cache, on the draft's device and dtype (median of ``reps`` after a warm-up, random context). Measured
    once per (rows, sampling, device, dtype); the scheduler adds it to the time of each drafted round."""
    device = draft.device
    table = measured_draft_seconds(draft)
    key = (rows, do_sample, str(device), draft.dtype)
    if key not in table:
        c = draft.config
        fused = torch.randn(rows, context, c.hidden_size, generator=torch.Generator().manual_seed(0))
        positions = torch.arange(context).expand(rows, -1).to(device)
        ctx = DraftContext.empty(draft, rows, device)
        ctx.extend(fused.to(device, draft.dtype), positions, torch.ones(rows, context, dtype=torch.bool, device=device))
        histories = list(torch.zeros(rows, 1, dtype=torch.long, device=device))  # the ids do not change the cost
        anchors = torch.full((rows,), context, device=device)
        # sampled blocks draw from the global generator: restore it, so a seeded generate is reproducible whether
        # or not its first call measured the draft
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            block = (draft, ctx, histories, anchors, c.num_draft_tokens, LogitsProcessorList(), do_sample)
            table[key] = _median_seconds(lambda: draft_block(*block), device, reps)
    return table[key]


def _median_seconds(run, device: torch.device, reps: int) -> float:
    """Median wall time of ``run()`` over ``reps`` calls after one warm-up, synchronising CUDA around each."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    times = []
    for _ in range(reps + 1):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


@torch.no_grad()
def tree_draft_seconds(draft: DSparkDraftModel, top_k: int, context: int = 256, reps: int = 3) -> float:
    """Seconds one token tree's drafting costs a row at most (backbone + the head at every node expanded to the
    block's full depth, ``top_k`` children per node), measured like :func:`draft_seconds` once per setting."""
    from .proposers import DraftTreeProposer, TreeRequest
    from .tree import TokenTree

    device = draft.device
    table = measured_draft_seconds(draft)
    key = ("tree", top_k, str(device), draft.dtype)
    if key not in table:
        c = draft.config
        fused = torch.randn(1, context, c.hidden_size, generator=torch.Generator().manual_seed(0))
        ctx = DraftContext.empty(draft, 1, device)
        ctx.extend(fused.to(device, draft.dtype), torch.arange(context, device=device)[None],
                   torch.ones(1, context, dtype=torch.bool, device=device))  # fmt: skip
        proposer = DraftTreeProposer(draft, ctx, top_k)
        # an unbounded budget: no early stop, the cost of the deepest tree this setting drafts
        request = TreeRequest(torch.zeros(1, dtype=torch.long, device=device), torch.tensor(context, device=device),
                              c.num_draft_tokens, 10**6, LogitsProcessorList())  # fmt: skip
        table[key] = _median_seconds(lambda: proposer.propose(TokenTree(), request), device, reps)
    return table[key]


def round_prices(draft: DSparkDraftModel, target, rows: int, do_sample: bool):
    """What the scheduler prices a batch of ``rows`` with: (verify profile, seconds of a draft block, the planner's
    profile = the verify profile with the draft block's cost added to every step)."""
    sps, drafting = sps_profile(draft, target, rows), draft_seconds(draft, rows, do_sample)
    return sps, drafting, sps.plus_seconds(drafting)


def profile_rows(active: int, batch: int) -> int:
    """The batch size whose SPS profile prices a batch that shrank from ``batch`` to ``active`` rows: the next
    power of two (at most ``batch``), so a shrinking batch measures O(log R) profiles rather than one per size."""
    return min(batch, 1 << (active - 1).bit_length())


def measure_sps(draft: DSparkDraftModel, *batch_sizes: int) -> DSparkDraftModel:
    """Measure now (or load from the disk cache) the SPS profiles that scheduled ``generate`` uses for batches of
    these sizes (default: 1) on the draft's attached target, and the draft block's own cost for them (greedy), so
    the first call does not pay for them. Returns ``draft``. A profile the user set (``draft.sps_profile``)
    replaces the measured verify profiles; the draft's cost is still measured."""
    for rows in batch_sizes or (1,):
        if not isinstance(rows, int) or rows < 1:
            raise ValueError(f"batch sizes must be positive integers, got {rows!r}")
        sps_profile(draft, draft.target, rows)
        draft_seconds(draft, rows)
    return draft
