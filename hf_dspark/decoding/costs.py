"""Every measurement the scheduler prices a round with: the target's verify profile (timed, cached on disk) and the
draft block's own cost. The scheduler's policy (:mod:`hf_dspark.scheduling.policy`) is a function of these numbers only.

    sps_profile     the target's steps per second for each verify shape of a batch (measured once, cached on disk)
    measure_profile the timing itself: ``time_verify_steps`` over a grid, the disk cache, the staleness probe
    draft_seconds   what one whole draft block costs for a batch (measured once per process)
    round_prices    both, for a chain round
    measure_sps     pay both ahead of the first ``generate`` call

Measurements are remembered per draft in weak-keyed tables (a draft that is freed takes its entries with it); a
profile the user sets (``draft.sps_profile``) replaces the measured verify profiles.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
import weakref
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers.generation import LogitsProcessorList
from transformers.utils.logging import is_progress_bar_enabled

from ..model.modeling_dspark import DSparkDraftModel
from ..scheduling.chains import ChainSchedule
from ..scheduling.observed import ObservedRounds
from ..scheduling.policy import SPSProfile
from ..scheduling.trees import TreeSchedule
from ..settings import DecodingConfig
from .drafting import DraftContext, draft_block
from .lm_head import head_orientation, verify_head

CACHE_DIR = Path(os.environ.get("HF_DSPARK_CACHE", "~/.cache/hf_dspark")).expanduser() / "sps"
# A cached profile records how long a one-token step on a short cache took when it was measured (the probe). If the
# same probe now takes more than STALE_RATIO times longer or shorter, the machine is not in the state the profile
# describes (it was measured under another job's load, or the hardware changed): the profile is measured again.
PROBE_CONTEXT = 32
STALE_RATIO = 1.3
_probes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> {(device, dtype): probe seconds}

# draft -> {(target id, dtype, device, rows): (weak reference to the target, profile)}
_MEASURED_SPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# draft -> {(rows, do_sample, device, dtype): seconds of one draft block,
#          ("tree", top_k, rows, device, dtype): seconds of one round of tree drafting}
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
        profile = measure_profile(target, grid=grid, rows=rows)
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
def tree_draft_seconds(draft: DSparkDraftModel, top_k: int, rows: int = 1, context: int = 256, reps: int = 3) -> float:
    """Seconds one round of token-tree drafting costs a batch of ``rows`` rows, every row drafting, at most: one
    backbone pass over the batch, then the head at every node of each row's tree expanded to the block's full
    depth (``top_k`` children per node). Measured like :func:`draft_seconds` once per setting. A batch's rounds
    share the backbone, so this is far less than ``rows`` times one row's cost."""
    from .proposers import DraftTreeProposer, RowRequest
    from .tree import TokenTree

    device = draft.device
    table = measured_draft_seconds(draft)
    key = ("tree", top_k, rows, str(device), draft.dtype)
    if key not in table:
        c = draft.config
        fused = torch.randn(rows, context, c.hidden_size, generator=torch.Generator().manual_seed(0))
        ctx = DraftContext.empty(draft, rows, device)
        ctx.extend(fused.to(device, draft.dtype), torch.arange(context, device=device).expand(rows, -1),
                   torch.ones(rows, context, dtype=torch.bool, device=device))  # fmt: skip
        proposer = DraftTreeProposer(draft, ctx, top_k)
        # an unbounded budget: no early stop, the cost of the deepest trees this setting drafts
        anchor, position = torch.zeros(1, dtype=torch.long, device=device), torch.tensor(context, device=device)
        requests = [
            RowRequest(r, anchor, position, c.num_draft_tokens, 10**6, LogitsProcessorList()) for r in range(rows)
        ]
        table[key] = _median_seconds(lambda: proposer.propose([TokenTree() for _ in requests], requests), device, reps)
    return table[key]


def observed_rounds(current: ObservedRounds | None, draft: DSparkDraftModel, recalibrate: bool):
    """The call's :class:`ObservedRounds`: ``current`` once made; a new one when the call recalibrates its costs and
    they are measured (a profile the user set, ``draft.sps_profile``, is taken as given); else ``None``."""
    if current is None and recalibrate and draft.sps_profile is None:
        return ObservedRounds()
    return current


def round_prices(draft: DSparkDraftModel, target, rows: int, do_sample: bool) -> tuple[SPSProfile, float]:
    """What the chain schedule prices a batch of ``rows`` with: (verify profile, seconds of a draft block)."""
    return sps_profile(draft, target, rows), draft_seconds(draft, rows, do_sample)


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


def profile_cache_key(
    target, device: torch.device, dtype: torch.dtype, grid: list[int], context: int, rows: int = 1
) -> tuple[str, dict]:
    """The disk-cache key of a profile and what it identifies (target, device, dtype, versions, grid, call)."""
    import transformers

    ident = {
        "target": getattr(target.config, "_name_or_path", "") or target.config.model_type,
        "config": hashlib.sha1(target.config.to_json_string().encode()).hexdigest()[:12],
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "dtype": str(dtype),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "grid": grid,
        "context": context,
        "rows": rows,
        "call": "loop-v2",  # what is timed: the loop's call (positions, hidden states, masked batches)
        "lm_head": head_orientation(target),  # how the loop computes the head's logits here (lm_head.py)
    }
    return hashlib.sha1(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20], ident


def measure_profile(
    target,
    grid: list[int] | None = None,
    context: int = 256,
    reps: int = 5,
    cache_dir: str | Path | None = CACHE_DIR,
    rows: int = 1,
) -> SPSProfile:
    """The target's SPS profile, timed on this engine: the target verifying B tokens after a ``context``-token
    cache, for B in ``grid`` (median of ``reps``), on its own device and dtype. Cached as JSON per (target, device,
    dtype, versions, grid); a corrupt or mismatched cache file is rebuilt, and so is a stale one: each file keeps the
    probe (:func:`probe_seconds`) timed with it, and a file whose probe differs from today's by more than
    ``STALE_RATIO`` either way is measured again. The measured table is made non-increasing (running min),
    since timing noise must not make the scheduler believe a longer step is faster. ``rows`` > 1 times the
    [rows, B / rows] blocks of a padded batched verify (B in ``grid`` must be multiples of ``rows``)."""

    grid = sorted(set(grid or [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 17]))
    key, ident = profile_cache_key(target, target.device, target.dtype, grid, context, rows)
    path = Path(cache_dir) / f"{key}.json" if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            saved = json.loads(path.read_text())
            ratio = float(saved["probe"]) / probe_seconds(target)
            if saved["ident"] == ident and 1 / STALE_RATIO <= ratio <= STALE_RATIO:
                return SPSProfile.from_table({int(b): s for b, s in saved["table"].items()})
        except (ValueError, KeyError, TypeError, ZeroDivisionError):
            pass  # corrupt or from an older version: measure again and overwrite
    probe = probe_seconds(target, fresh=True) if path is not None else None  # the state the table is timed in
    # a one-time cost (seconds idle, minutes on a loaded CPU): shown, with where its result is kept
    label = f"timing the target's verify steps once (cached in {path.parent})" if path else "timing verify steps"
    timed = time_verify_steps(target, grid, context, reps, rows, progress=label)
    table = {B: 1.0 / seconds for B, seconds in timed.items()}
    running = float("inf")
    for B in grid:
        running = min(running, table[B])
        table[B] = running
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # processes measuring at once: own temp files
        tmp.write_text(json.dumps({"ident": ident, "probe": probe, "table": table}))
        tmp.replace(path)
    return SPSProfile.from_table(table)


def probe_seconds(target, fresh: bool = False) -> float:
    """Seconds of one one-token target step after a ``PROBE_CONTEXT``-token cache (median of 3): a cheap reading
    of how fast the engine runs, taken once per process per (target, device, dtype) unless ``fresh``."""
    key = (str(target.device), target.dtype)
    seen = _probes.setdefault(target, {})
    if fresh or key not in seen:
        seen[key] = time_verify_steps(target, [1], context=PROBE_CONTEXT, reps=3)[1]
    return seen[key]


@torch.no_grad()
def time_verify_steps(
    target, grid: list[int], context: int = 256, reps: int = 5, rows: int = 1, progress: str | None = None
) -> dict[int, float]:
    """Median seconds of one target forward over B new tokens after a ``context``-token cache, for B in ``grid``
    (random token ids; ``reps + 1`` passes over the whole grid, so drift hits every B alike, the first a warm-up).
    The call is the one the decoding loop makes (explicit positions, no hidden states returned). With ``rows`` > 1
    the B tokens are a [rows, B / rows] block on a batch of ``rows`` caches, the shape a padded batched verify
    has (every B must then be a multiple of ``rows``), under a 2-D attention mask with a padding hole as a
    left-padded batch carries (on CPU a masked step takes another attention path and costs differently).
    Raw times: not made monotone. ``progress``: a label for a progress bar (tqdm, on stderr, shown once the
    timing has run for two seconds, off where transformers' progress bars are off)."""
    from transformers import DynamicCache

    from .versions import cache_argument

    grid = sorted(set(grid))
    if rows < 1 or any(B % rows for B in grid):
        raise ValueError(f"every B in the grid must be a positive multiple of rows = {rows}, got {grid}")
    vocab = target.config.get_text_config().vocab_size
    width = max(grid) // rows
    device = target.device
    ids = torch.randint(0, vocab, (rows, context + width), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones(rows, context + width, dtype=torch.long, device=device)
    if rows > 1:
        mask[0, 0] = 0
    positions = (mask.cumsum(-1) - 1).clamp_min(0)

    def forward(start: int, stop: int):
        attention = mask[:, :stop] if rows > 1 else None
        with verify_head(target):
            target(input_ids=ids[:, start:stop], position_ids=positions[:, start:stop], attention_mask=attention,
                   use_cache=True, **{cache_argument(type(target)): cache})  # fmt: skip

    cache = DynamicCache()
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    forward(0, context)
    times: dict[int, list[float]] = {B: [] for B in grid}
    shown = progress is not None and is_progress_bar_enabled()
    with tqdm(total=(reps + 1) * len(grid), desc=progress, unit="step", delay=2.0, disable=not shown) as bar:
        for _ in range(reps + 1):
            for B in grid:
                W = B // rows
                sync()
                t0 = time.perf_counter()
                forward(context, context + W)
                sync()
                times[B].append(time.perf_counter() - t0)
                cache.crop(-W)
                bar.update()
    return {B: statistics.median(t[1:]) for B, t in times.items()}


class PricedRounds:
    """What the chain and tree rounds share: the call's ``settings`` and its ``schedule`` (a
    :class:`~hf_dspark.scheduling.chains.ChainSchedule` or :class:`~hf_dspark.scheduling.trees.TreeSchedule`), whether
    the mode prices its rounds, the widths verifies pad to, and each round's wall time against its price
    (``observed``, with measured costs). The loop's one round (``loop.play_round``) drives either through one
    interface: ``requests(state, max_length, processors, sample)`` (a :class:`~hf_dspark.decoding.proposers.RowRequest`
    per row), ``proposers`` (run in order over a fresh ``empty()`` candidate set per request),
    ``choose(call, candidates, requests, state)`` (each batch row's :class:`~hf_dspark.decoding.tree.VerifiedTree`, None
    when finished) and ``observe(call, candidates, requests, verified, walks)``; between rounds, ``price(call, rows)``
    (before the first round and after the batch shrinks) and ``keep_rows(index)`` (after
    :meth:`~hf_dspark.decoding.state.DecodeState.compact`)."""

    settings: DecodingConfig
    schedule: ChainSchedule | TreeSchedule

    @property
    def priced(self) -> bool:
        return self.settings.priced

    @property
    def observed(self) -> ObservedRounds | None:
        return self.schedule.observed

    @property
    def buckets(self) -> tuple[int, ...] | None:
        return self.schedule.buckets

    def time_round(self, seconds: float) -> None:
        """A round just ran in ``seconds``: what it cost against its price (the premium a drafted round must pay)."""
        if self.observed is not None:
            self.observed.finish(seconds)
