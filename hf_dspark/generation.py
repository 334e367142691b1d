"""The DSpark decoding loop, gpt-fast style: one function per idea.

    draft_block     one backbone pass for all rows, then the sequential head left to right -> tokens, q, c
    choose_lengths  how many draft tokens each row verifies (fixed γ, a confidence threshold, or the scheduler)
    draft_seconds   what one draft block costs; the scheduler prices each drafted round with it
    lookups         lookup drafting (optional): rows whose last n-gram repeats verify what followed it instead
    verify_row      exact acceptance for one row -> accepted prefix + correction/bonus token
    dspark_decode   the loop: prefill, then draft, choose, verify (one target forward for all rows), commit

Invariant between rounds: the target's KV cache holds every committed token of each row except its last one (the
row's *anchor*); the draft's context cache holds the projected keys/values of the same slots. Rows of a batch
accept different numbers of tokens, so the caches keep one column per verified slot and an attention mask marks
the slots that hold committed tokens (rejected drafts and padding are holes). Columns that are holes in every row
at the end of a round are cropped, so a single row never carries holes.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import statistics
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.generation import GenerateDecoderOnlyOutput, GenerationConfig, LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from .configuration_dspark import VERIFY_LAYOUTS, VERIFY_MODES, DSparkConfig
from .kernels import fused_head_step, fused_temperature, use_kernels
from .lookup import lookup_continuation, one_hot_probs
from .modeling_dspark import DSparkDraftModel
from .scheduler import (
    ColumnPlan,
    SPSProfile,
    drafting_pays,
    fill_top_k,
    plan_capacity,
    plan_capacity_width,
    plan_verify_lengths,
    plan_verify_width,
)
from .stats import DSparkStats
from .verify import greedy_accept, rejection_sample
from .versions import CACHE_FIELD, cache_argument, cache_from

MAX_BACKOFF = 16  # most plain rounds in a row before the draft is asked again (scheduled/async modes)
# Stop the sequential head as soon as the plan cannot grow (scheduled and threshold modes). The planners stop at
# the first column that does not pay and never look further, so the verify lengths are the same either way;
# False drafts every slot (tests compare the two).
STOP_DRAFTING_EARLY = True


def _probs(scores: torch.Tensor) -> torch.Tensor:
    return torch.softmax(scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores, dim=-1)


def _process(logits_processor: LogitsProcessorList, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Apply the target's logits processors to one position of one row: ids [1, T] (its history), scores [1, V]."""
    return logits_processor(ids, scores) if logits_processor else scores


FLUSH_CHUNK = 1024  # context positions projected per call (every position is projected on its own)


@dataclass
class DraftContext:
    """The draft's cache of projected context keys/values, one (k, v) pair per draft layer: [R, KV, L, hd].

    New fused context (the target's tapped layers through ``fc``: :class:`LayerTap`) is queued by :meth:`extend`
    and projected to keys/values by :meth:`flush`, which the next drafted block calls first: rounds that do not
    draft (back-off, length limit) project nothing, and the queued rounds are projected in one call."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    valid: torch.Tensor  # [R, L] bool: False for padding and rejected slots (flushed slots only)
    pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def extend(self, fused: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """Queue new fused context [R, n, d] at positions [R, n] (valid [R, n]) for the next flush."""
        self.pending.append((fused, positions, valid))

    def flush(self, draft: DSparkDraftModel) -> None:
        """Project the queued context (only that: the cache keeps earlier projections) and append it."""
        if not self.pending:
            return
        fused, positions, valid = (
            parts[0] if len(parts) == 1 else torch.cat(parts, dim=1) for parts in zip(*self.pending, strict=True)
        )  # one queued round (the prefill, a drafted round) is used as it is: no copy of a long prompt's states
        self.pending = []
        if not bool(valid.all()):  # holes may hold garbage; keep it out of the cache
            fused = torch.where(valid[..., None], fused, 0)
        # a long prompt is projected FLUSH_CHUNK positions at a time: the projection's intermediates stay small
        chunks = [
            draft.fused_key_values(fused[:, i : i + FLUSH_CHUNK].to(draft.dtype), positions[:, i : i + FLUSH_CHUNK])
            for i in range(0, fused.shape[1], FLUSH_CHUNK)
        ]
        self.keys = [torch.cat([k, *(c[j][0] for c in chunks)], dim=2) for j, k in enumerate(self.keys)]
        self.values = [torch.cat([v, *(c[j][1] for c in chunks)], dim=2) for j, v in enumerate(self.values)]
        self.valid = torch.cat([self.valid, valid], dim=1)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows ``rows`` [R'] (indices), in that order."""
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.valid = self.valid[rows]
        self.pending = [tuple(x[rows] for x in queued) for queued in self.pending]

    @classmethod
    def empty(cls, draft: DSparkDraftModel, rows: int, device: torch.device) -> DraftContext:
        c = draft.config
        kv = torch.empty(rows, c.num_key_value_heads, 0, c.head_dim, device=device, dtype=draft.dtype)
        n = len(draft.layers)
        return cls([kv] * n, [kv] * n, torch.empty(rows, 0, dtype=torch.bool, device=device))


@dataclass
class Proposal:
    """Drafted blocks for R rows: tokens [R, G], processed draft probabilities q [R, G, V] (sampling only),
    confidences c [R, G] or None. G is the largest number of tokens any row may verify this round."""

    tokens: torch.Tensor
    probs: torch.Tensor | None
    confidences: torch.Tensor | None


@dataclass
class DSparkGenerateOutput(GenerateDecoderOnlyOutput):
    """``generate``'s output with ``return_dict_in_generate=True``, plus this call's own per-round statistics
    (``draft.stats`` is whichever call on the draft finished last, which differs when threads share a draft)."""

    dspark_stats: DSparkStats | None = None


def target_features(draft: DSparkDraftModel, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The target layers the draft reads, hidden_states[l + 1] for l in target_layer_ids: -> [R, n, m·d_t]."""
    return torch.cat([hidden_states[layer + 1] for layer in draft.config.target_layer_ids], dim=-1)


class LayerTap:
    """Fuses, during a target forward, the hidden states of the decoder layers the draft reads into the draft's
    context input as each layer runs: [R, n, d] (:meth:`DSparkDraftModel.fuse_context`), never [R, n, m·d_t].

    ``output_hidden_states=True`` materialises every layer's [R, T, d_t] (at a 32k-token prompt on Qwen3-8B, 37 ×
    32,768 × 4,096 × 2 B ≈ 9.9 GB); forward hooks on the ``target_layer_ids`` layers add each one's share of the
    fusion into one [R, n, d] buffer, so at most one tapped layer's states are alive beside it. Their outputs are
    ``hidden_states[l + 1]`` exactly for every layer but the last (whose entry is after the final norm), so a draft
    reading the last layer, or a model whose decoder layers are not found, falls back to ``output_hidden_states``.
    Hooks record only forwards run by the thread that made the tap, so two calls sharing a target in two threads
    do not see each other's states. Use as a context manager.
    """

    def __init__(self, target, draft: DSparkDraftModel):
        self.draft = draft
        self.layer_ids = list(draft.config.target_layer_ids)
        self.buffer: torch.Tensor | None = None  # [R, n, d], summed slot by slot as the layers run
        self.handles = []
        self.thread = threading.get_ident()
        decoder = target.get_decoder() if hasattr(target, "get_decoder") else None
        layers = getattr(decoder, "layers", None)
        n = target.config.get_text_config().num_hidden_layers
        if isinstance(layers, torch.nn.ModuleList) and len(layers) == n and max(self.layer_ids) < n - 1:
            self.handles = [layers[layer].register_forward_hook(self._hook(layer)) for layer in set(self.layer_ids)]

    @property
    def active(self) -> bool:
        return bool(self.handles)

    def _hook(self, layer: int):
        slots = [i for i, tapped in enumerate(self.layer_ids) if tapped == layer]

        def keep(module, args, output):
            if threading.get_ident() != self.thread or self.buffer is None:
                return
            hidden = output[0] if isinstance(output, tuple) else output
            for slot in slots:  # fused at once, so the layer's own output can be freed as the model goes on
                self.draft.fuse_layer_into(self.buffer, slot, hidden)

        return keep

    def expect(self, rows: int, tokens: int, device) -> None:
        """Allocate the [rows, tokens, d] buffer the next forward fills."""
        if self.active:
            shape = (rows, tokens, self.draft.config.hidden_size)
            self.buffer = torch.zeros(shape, dtype=self.draft.dtype, device=device)

    def fused(self, out) -> torch.Tensor:
        """The draft's fused context input [R, n, d] of the forward that produced ``out`` (from its hidden states
        when the tap is inactive)."""
        if not self.active:
            return self.draft.fuse_context(target_features(self.draft, out.hidden_states).to(self.draft.dtype))
        fused, self.buffer = self.buffer, None
        return fused

    def __enter__(self) -> LayerTap:
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self.buffer = [], None


def _target_forward(target, ids, positions, attention_mask, cache, tap: LayerTap, last_logits_only: bool = False):
    """One target forward that extends ``cache``; returns (the model output, the draft's fused context [R, n, d]).
    ``last_logits_only`` (the prefill) asks the model for the last position's logits alone: the prompt's other
    positions need only hidden states, and their LM head would cost more than the rest of a long batched prefill on
    a CPU."""
    extra = {"logits_to_keep": 1} if last_logits_only and _takes_logits_to_keep(type(target)) else {}
    extra[cache_argument(type(target))] = cache
    tap.expect(ids.shape[0], ids.shape[1], ids.device)
    out = target(
        input_ids=ids,
        position_ids=positions,
        attention_mask=attention_mask,
        use_cache=True,
        output_hidden_states=not tap.active,
        **extra,
    )
    return out, tap.fused(out)


@functools.cache
def _takes_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def _head_and_confidence(draft, logits, h_k, prev, state, conf_temperature, rows=None):
    """The sequential head's bias added to one slot's logits (over W2's ``rows`` when given) and the slot's
    confidence: -> (logits, confidences [R] or None, head state)."""
    head, conf_head, feature, conf = draft.sequential_head, draft.confidence, None, None
    if head is not None:
        bias, feature, state = head.step(prev, h_k, state, rows=rows)
        if draft.head_enabled:
            logits = logits + bias
    if conf_head is not None:
        conf = conf_head.calibrated(conf_head.logit(h_k, feature), conf_temperature)
    return logits, conf, state


def _torch_slot(draft, logits, h_k, prev, state, histories, logits_processor, do_sample, conf_temperature):
    """One slot on the PyTorch path: head bias, confidence, the target's processors (per row, with that row's
    history), argmax or sample. -> (tokens [R], processed probs [R, V] or None, confidences [R] or None, state)."""
    logits, conf, state = _head_and_confidence(draft, logits, h_k, prev, state, conf_temperature)
    logits = logits.to(torch.float32 if logits.dtype != torch.float64 else logits.dtype)
    if logits_processor:
        logits = torch.cat(
            [_process(logits_processor, ids[None], logits[r : r + 1]) for r, ids in enumerate(histories)]
        )
    if not do_sample:
        return logits.argmax(-1), None, conf, state
    p = _probs(logits)
    return torch.multinomial(p, 1)[:, 0], p, conf, state


def _subset_slot(draft, logits, h_k, prev, state, histories, logits_processor, do_sample, conf_temperature, *,
                 rows, vocab):  # fmt: skip
    """Greedy slot over a draft vocabulary: logits [R, Vd] and the head's bias from W2's ``rows`` [Vd, r];
    the argmax column maps back to a token id through ``vocab``. Same tokens as ``_torch_slot`` on the -inf-padded
    full logits (``vocab`` is sorted, so ties resolve to the same token)."""
    logits, conf, state = _head_and_confidence(draft, logits, h_k, prev, state, conf_temperature, rows)
    return vocab[logits.float().argmax(-1)], None, conf, state


def _kernel_slot(draft, logits, h_k, prev, state, histories, logits_processor, do_sample, conf_temperature):
    """The same slot through the fused Triton step (temperature is the only processing it fuses)."""
    temperature = fused_temperature(logits_processor)
    _, token, p, conf, state = fused_head_step(
        draft, logits, h_k, prev, state, temperature, do_sample, conf_temperature
    )
    return token, p, conf, state


@torch.no_grad()
def draft_block(
    draft: DSparkDraftModel,
    context: DraftContext,
    histories: list[torch.Tensor],
    anchor_positions: torch.Tensor,
    max_tokens: int,
    logits_processor: LogitsProcessorList,
    do_sample: bool,
    enough: Callable[[torch.Tensor], bool] | None = None,
) -> Proposal:
    """Propose ``max_tokens`` (≤ the draft's tokens per block) tokens after each row's anchor ``histories[r][-1]``
    (at ``anchor_positions``).

    One backbone forward gives U, h for all rows and slots; the sequential head then adds its bias left to right,
    each position's logits are processed exactly like the target's, and a token is chosen (argmax or sample).
    ``enough(confidences [R])``, called with each slot's confidences (float64) as they come, ends the block early
    (fewer than ``max_tokens`` tokens) when it says no later slot will be verified.
    """
    gamma = draft.config.block_size
    device = anchor_positions.device
    anchors = torch.stack([h[-1] for h in histories])
    R = anchors.shape[0]
    if max_tokens == 0:
        no_conf = None if draft.confidence is None else torch.empty(R, 0, device=device)
        return Proposal(anchors.new_empty(R, 0), None, no_conf)
    context.flush(draft)
    positions = anchor_positions[:, None] + torch.arange(gamma, device=device)
    mask = None
    if not bool(context.valid.all()):
        mask = torch.cat([context.valid, torch.ones(R, gamma, dtype=torch.bool, device=device)], dim=1)
        mask = mask[:, None, :].expand(R, gamma, -1)
    step = _kernel_slot if use_kernels(draft, device, logits_processor) else _torch_slot
    # greedy with no logits processors and a draft vocabulary: choose tokens inside the subset, never building
    # [R, V] logits (the head's bias and the argmax then cover len(draft_vocab) columns instead of V)
    subset = step is _torch_slot and not do_sample and not logits_processor and draft.draft_vocab is not None
    context_kv = list(zip(context.keys, context.values, strict=True))
    out = draft(draft.embed_block(anchors), positions, context_kv, mask, compute_logits=not subset)
    logits = draft.draft_vocab_logits(out.hidden_states) if subset else out.logits
    if subset:
        step = functools.partial(_subset_slot, rows=draft.head_vocab_rows(), vocab=draft.draft_vocab)
    temps, off = draft.config.sts_temperatures, draft.config.draft_offset
    tokens, probs, confs = [], [], []
    prev, state = anchors, None
    for k in range(max_tokens):
        hist = histories  # the processors see each row's history including this block's earlier tokens
        if logits_processor and tokens:
            so_far = torch.stack(tokens, dim=1)
            hist = [torch.cat([h, so_far[r]]) for r, h in enumerate(histories)]
        slot = k + off  # DFlash convention: the anchor slot proposes nothing
        token, p, conf, state = step(
            draft, logits[:, slot], out.hidden_states[:, slot], prev, state, hist, logits_processor, do_sample,
            temps[k] if temps else None,
        )  # fmt: skip
        tokens.append(token)
        if p is not None:
            probs.append(p)
        if conf is not None:
            confs.append(conf)
        prev = token
        if enough is not None and enough(conf.double()):
            break
    return Proposal(
        tokens=torch.stack(tokens, dim=1),
        probs=torch.stack(probs, dim=1) if do_sample else None,
        confidences=torch.stack(confs, dim=1).double() if confs else None,
    )


@dataclass(frozen=True)
class DecodeSettings:
    """How one ``generate`` call verifies: the draft's saved config, with the call's own overrides.

    Overrides never touch ``draft.config``, so calls with different settings may share one draft (two visitors of
    the demo, two threads). ``verify_mode`` is resolved: ``auto`` becomes ``scheduled`` with a confidence head,
    else ``fixed``.
    """

    verify_mode: str
    verify_limit: int | None
    confidence_threshold: float
    verify_layout: str
    lookup_max_ngram: int
    lookup_min_ngram: int

    @classmethod
    def resolve(cls, draft: DSparkDraftModel, **overrides) -> DecodeSettings:
        """The config's values, replaced by the non-``None`` ``overrides``; ``ValueError`` naming a bad value."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise ValueError(f"unknown DSpark settings {unknown}: use any of {names}")
        values = {name: getattr(draft.config, name) for name in names}
        values.update({k: v for k, v in overrides.items() if v is not None})
        mode = values["verify_mode"]
        if mode not in VERIFY_MODES:  # the config checks on construction; this catches later assignments
            raise ValueError(f"verify_mode must be one of {VERIFY_MODES}, got {mode!r}")
        if mode == "auto":
            values["verify_mode"] = mode = "scheduled" if draft.confidence is not None else "fixed"
        if draft.confidence is None and mode != "fixed":
            raise ValueError(f"verify_mode={mode!r} needs a confidence head (the draft has confidence_head=False)")
        limit = values["verify_limit"]
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(f"verify_limit must be an int >= 0 (or None: γ), got {limit!r}")
        if not 0 <= values["confidence_threshold"] <= 1:
            raise ValueError(f"confidence_threshold must lie in [0, 1], got {values['confidence_threshold']!r}")
        if values["verify_layout"] not in VERIFY_LAYOUTS:
            raise ValueError(f"verify_layout must be one of {VERIFY_LAYOUTS}, got {values['verify_layout']!r}")
        settings = cls(**values)
        DSparkConfig.validate_lookup(settings)  # the same rule the config applies to its own fields
        return settings


def sps_profile(draft: DSparkDraftModel, target, rows: int) -> SPSProfile:
    """``draft.sps_profile`` if set; else the target's profile for a batch of ``rows``, measured on the shapes this
    loop verifies ([rows, 1 + ℓ] blocks, ℓ = 0..γ) once per (target, dtype, device, rows) and cached on disk."""
    if getattr(draft, "sps_profile", None) is not None:
        return draft.sps_profile
    key = (id(target), target.dtype, str(target.device), rows)
    owner, profile = draft.measured_sps.get(key, (None, None))
    if owner is None or owner() is not target:  # a weak reference: a new target at a freed one's address re-measures
        grid = [rows * width for width in range(1, draft.config.num_draft_tokens + 2)]
        profile = SPSProfile.measure(target, grid=grid, rows=rows)
        draft.measured_sps[key] = (weakref.ref(target), profile)
    return profile


@torch.no_grad()
def draft_seconds(
    draft: DSparkDraftModel, rows: int, do_sample: bool = False, context: int = 256, reps: int = 3
) -> float:
    """Seconds one whole draft block (backbone + every head slot) costs for ``rows`` rows after a ``context``-slot
    draft cache, on the draft's device and dtype (median of ``reps`` after a warm-up, random features). Measured
    once per (rows, sampling, device, dtype) and remembered in ``draft.measured_draft_seconds``; the scheduler
    adds it to the time of each drafted round."""
    device = draft.device
    key = (rows, do_sample, str(device), draft.dtype)
    if key not in draft.measured_draft_seconds:
        c = draft.config
        g = torch.Generator().manual_seed(0)
        fused = torch.randn(rows, context, c.hidden_size, generator=g)
        positions = torch.arange(context).expand(rows, -1).to(device)
        ctx = DraftContext.empty(draft, rows, device)
        ctx.extend(fused.to(device, draft.dtype), positions, torch.ones(rows, context, dtype=torch.bool, device=device))
        histories = list(torch.zeros(rows, 1, dtype=torch.long, device=device))  # the ids do not change the cost
        anchors = torch.full((rows,), context, device=device)
        sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
        times = []
        # sampled blocks draw from the global generator: restore it, so a seeded generate is reproducible whether
        # or not its first call measured the draft
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for _ in range(reps + 1):
                sync()
                start = time.perf_counter()
                draft_block(draft, ctx, histories, anchors, c.num_draft_tokens, LogitsProcessorList(), do_sample)
                sync()
                times.append(time.perf_counter() - start)
        draft.measured_draft_seconds[key] = statistics.median(times[1:])
    return draft.measured_draft_seconds[key]


def _prices(draft: DSparkDraftModel, target, rows: int, do_sample: bool):
    """What the scheduler prices a batch of ``rows`` with: (verify profile, seconds of a draft block, the planner's
    profile = the verify profile with the draft block's cost added to every step)."""
    sps, drafting = sps_profile(draft, target, rows), draft_seconds(draft, rows, do_sample)
    return sps, drafting, sps.plus_seconds(drafting)


def profile_rows(active: int, batch: int) -> int:
    """The batch size whose SPS profile prices a batch that shrank from ``batch`` to ``active`` rows: the next
    power of two (at most ``batch``), so a shrinking batch measures O(log R) profiles rather than one per size."""
    return min(batch, 1 << (active - 1).bit_length())


def choose_lengths(mode, confidences, caps, history, sps, threshold, layout: str = "padded") -> list[int]:
    """Draft tokens each row verifies. ``caps`` [R] bound them (length limit; 0 for finished rows); confidences
    beyond a cap count as 0, so the planners never admit them. ``history`` holds past rounds' confidences
    (the asynchronous variant sizes its capacity from the one two rounds back). ``layout``: ``padded`` plans
    whole columns of the [R, 1 + ℓ] verify block this loop runs (every row then verifies up to its cap),
    ``packed`` plans tokens as the paper's Algorithm 1 does for ragged kernels (B = Σ_r (1 + ℓ_r))."""
    if layout not in VERIFY_LAYOUTS:
        raise ValueError(f"verify_layout must be one of {VERIFY_LAYOUTS}, got {layout!r}")
    if mode == "fixed" or confidences is None or confidences.shape[1] == 0:
        return list(caps)
    planner = column_plan(mode, layout, caps, sps, threshold)
    if planner is not None:
        for k in range(confidences.shape[1]):
            if not planner.admit(confidences[:, k]):
                break
        return planner.lengths
    allowed = torch.arange(confidences.shape[1], device=confidences.device)[None] < torch.tensor(caps)[:, None]
    conf = torch.where(allowed, confidences, 0).cpu()
    old = history[-2] if mode == "async" and len(history) >= 2 and history[-2].shape == conf.shape else None
    if layout == "padded":  # async (column_plan covers scheduled); its first rounds have no old confidences
        width = plan_capacity_width(old, sps) if old is not None else plan_verify_width(conf, sps)
        return [min(width, cap) for cap in caps]
    return plan_verify_lengths(conf, sps) if old is None else fill_top_k(conf, plan_capacity(old, sps))


def column_plan(mode: str, layout: str, caps: list[int], sps, threshold: float) -> ColumnPlan | None:
    """A :class:`ColumnPlan` for the modes whose plan closes at the first column no row verifies, so drafting can
    stop there: ``threshold``, and ``scheduled`` on the padded layout (or one row, where a column is a token).
    None for the others: ``fixed``, packed multi-row Algorithm 1 (a later column's token could sort before an
    earlier row's) and ``async`` (it sizes from full past blocks)."""
    if mode == "threshold":
        return ColumnPlan(caps, threshold=threshold)
    if mode == "scheduled" and (layout == "padded" or len(caps) == 1):
        return ColumnPlan(caps, sps=sps)
    return None


def lookups(config, histories: list[torch.Tensor], room: list[int]) -> dict[int, torch.Tensor]:
    """Lookup drafting for one round: {row: the continuation [k ≤ room[r]] it verifies}, for the rows with room
    whose last n-gram occurred earlier in their history (``config.lookup_max_ngram`` down to ``lookup_min_ngram``)."""
    found = {}
    for r, h in enumerate(histories):
        if room[r] > 0:
            tokens = lookup_continuation(h, config.lookup_max_ngram, config.lookup_min_ngram, room[r])
            if tokens.numel():
                found[r] = tokens
    return found


def verify_row(draft_tokens, draft_probs, raw_logits, history, logits_processor, do_sample):
    """Exact acceptance for one row: draft_tokens [ℓ], draft_probs [ℓ, V] | None, raw target logits [ℓ+1, V],
    history [T] (the row's committed tokens) -> (n accepted, next token, processed target scores [ℓ+1, V])."""
    candidate = torch.cat([history, draft_tokens])
    base = history.shape[0]
    scores = torch.cat(
        [_process(logits_processor, candidate[None, : base + i], raw_logits[i : i + 1]) for i in range(len(raw_logits))]
    )
    if do_sample:
        n, nxt = rejection_sample(draft_tokens, draft_probs, _probs(scores))
    else:
        n, nxt = greedy_accept(draft_tokens, scores)
    return n, nxt, scores


# model kwargs generate prepares that the loop honours itself (positions: from the attention mask, as generate does)
HONOURED_MODEL_KWARGS = {"attention_mask", "cache", "past_key_values", "use_cache", "logits_to_keep", "position_ids"}


def _check_supported(generation_config: GenerationConfig, input_ids: torch.Tensor, model_kwargs: dict, streamer):
    R = input_ids.shape[0]
    unsupported = sorted(k for k, v in model_kwargs.items() if k not in HONOURED_MODEL_KWARGS and v is not None)
    if unsupported:
        raise ValueError(
            f"DSpark generation cannot honour {unsupported}: it drafts and verifies from input_ids, the attention "
            "mask and the cache alone (multimodal inputs, token_type_ids and other model inputs are not supported)"
        )
    if model_kwargs.get("use_cache") is False:
        raise ValueError("DSpark generation needs use_cache=True (a cache the verifier can crop).")
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError("DSpark generation does not return attentions or hidden states.")
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("DSpark generation needs input_ids (inputs_embeds is not supported).")
    if R > 1 and streamer is not None:
        raise ValueError("streamers need batch size 1 (rows of a DSpark batch advance by different amounts)")
    if (
        R > 1
        and generation_config.return_dict_in_generate
        and (generation_config.output_scores or generation_config.output_logits)
    ):
        raise ValueError("output_scores/output_logits with DSpark need batch size 1")


def _check_finite(logits: torch.Tensor) -> None:
    """Refuse non-finite target logits by name instead of failing later in the scheduler or sampler."""
    if not bool(torch.isfinite(logits).all()):
        raise ValueError(
            "the target returned non-finite logits (NaN/inf), which plain generate would return too: e.g. Gemma 2's "
            "eager attention in float64 overflows on the fully masked rows of left padding and spreads NaN to the "
            "real tokens. Use float32 (or bfloat16), or prompts without padding."
        )


def _sliding_window(cache) -> int | None:
    """The smallest sliding window among the cache's layers (``None``: no sliding-window layer)."""
    windows = [layer.sliding_window for layer in getattr(cache, "layers", []) if getattr(layer, "is_sliding", False)]
    return min(windows) if windows else None


def _check_cache(cache, rows: int, max_length: int) -> None:
    """Refuse, by name, the caches the verifier cannot roll back exactly."""
    from transformers import DynamicCache

    if cache is None:
        raise ValueError("DSpark generation needs use_cache=True (a cache the verifier can crop).")
    if not isinstance(cache, DynamicCache):
        raise ValueError(
            f"DSpark generation needs a DynamicCache, which it crops after each verify; got {type(cache).__name__} "
            "(leave cache_implementation unset)"
        )
    window = _sliding_window(cache)
    if window is not None and not hasattr(cache, "activate_past_recording"):
        raise ValueError("this transformers release cannot roll back a sliding-window cache (activate_past_recording)")
    if window is not None and rows > 1 and max_length > window:
        # rejected slots of one row are holes that count toward the window in a batch, unlike in plain generate
        raise ValueError(
            f"the target attends through a sliding window of {window} tokens: a batch of {rows} rows can decode "
            f"DSpark only within it (max_length {max_length} > {window}); run the rows one at a time"
        )


@torch.no_grad()
def dspark_decode(
    target,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    draft: DSparkDraftModel,
    streamer=None,
    synced_gpus: bool = False,
    settings: DecodeSettings | None = None,
    **model_kwargs,
):
    """DSpark decoding with the arguments ``GenerationMixin.generate`` prepares for a decoding method.

    ``input_ids`` [R, P] is a left-padded batch. ``settings``: this call's verify settings (default: the draft's
    config). Returns the sequences [R, P + new] (rows that finish early are padded with the pad token, as plain
    ``generate`` does), or a :class:`DSparkGenerateOutput` (``GenerateDecoderOnlyOutput`` plus this call's
    ``dspark_stats``) when ``return_dict_in_generate``. ``draft.stats`` is the last finished call's statistics.
    """
    with LayerTap(target, draft) as tap:
        return _decode(
            target, input_ids, logits_processor, stopping_criteria, generation_config, draft, streamer, synced_gpus,
            settings, tap, **model_kwargs,
        )  # fmt: skip


def _decode(
    target,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    draft: DSparkDraftModel,
    streamer,
    synced_gpus: bool,
    settings: DecodeSettings | None,
    tap: LayerTap,
    **model_kwargs,
):
    _check_supported(generation_config, input_ids, model_kwargs, streamer)
    if synced_gpus:
        raise ValueError("DSpark generation does not support synced_gpus (ZeRO-3 / FSDP sharded generation).")
    if not draft.is_attached or draft.target is not target:
        draft.attach(target)
    cache = cache_from(model_kwargs)
    _check_cache(cache, input_ids.shape[0], generation_config.max_length)
    R, device = input_ids.shape[0], input_ids.device
    do_sample, gamma = generation_config.do_sample, draft.config.num_draft_tokens
    want_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    want_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    scores_out, logits_out = [], []
    settings = settings if settings is not None else DecodeSettings.resolve(draft)
    mode = settings.verify_mode
    lookup_on = settings.lookup_max_ngram > 0
    # the scheduler prices a drafted round as the draft block plus the verify step (sps: the verify step alone)
    priced = mode in ("scheduled", "async")
    sps, drafting, planning = _prices(draft, target, R, do_sample) if priced else (None, 0.0, None)
    stats = DSparkStats(block_size=gamma)
    draft.stats = stats  # the running call's, as it runs (set again at the end: the last call to finish)
    max_length = generation_config.max_length
    pad = generation_config._pad_token_tensor
    pad_id = int(pad) if pad is not None else 0

    # --- prefill ------------------------------------------------------------------------------------------------
    attention_mask = model_kwargs.get("attention_mask")
    cache_mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    positions = (cache_mask.long().cumsum(-1) - 1).clamp_min(0)
    given = model_kwargs.get("position_ids")
    if given is not None and not torch.equal(given[cache_mask.bool()].to(positions), positions[cache_mask.bool()]):
        raise ValueError("DSpark generation counts positions from the attention mask; other position_ids are not "
                         "supported")  # fmt: skip
    out, fused = _target_forward(target, input_ids, positions, attention_mask, cache, tap, last_logits_only=True)
    if _sliding_window(cache) is not None:  # after the prefill, as generate does: keep rejected slots until cropped
        cache.activate_past_recording()
    context = DraftContext.empty(draft, R, device)
    context.extend(fused, positions, cache_mask.bool())
    raw = out.logits[:, -1]
    _check_finite(raw)
    scores = _process(logits_processor, input_ids, raw.float() if raw.dtype != torch.float64 else raw)
    first = torch.multinomial(_probs(scores), 1)[:, 0] if do_sample else scores.argmax(-1)
    if want_scores:
        scores_out.append(scores)
    if want_logits:
        logits_out.append(raw)
    histories = [torch.cat([input_ids[r], first[r : r + 1]]) for r in range(R)]
    finished = [bool(stopping_criteria(histories[r][None], scores[r : r + 1]).any()) for r in range(R)]
    anchor_pos = positions[:, -1] + 1
    if streamer is not None:
        streamer.put(first.cpu())
    conf_history: list[torch.Tensor] = []
    # Rows leave the batch when they finish (their KV rows are dropped from both caches), so they stop costing
    # verify and draft work. Not when the caller asked for the cache back, which then covers every row.
    batch_rows, done = list(range(R)), {}
    compact = hasattr(cache, "batch_select_indices") and not generation_config.return_dict_in_generate
    # When a drafted round was not worth its cost in expectation (drafting_pays: the tokens its plan expected per
    # second of drafting + verifying, against a plain step), skip drafting for `backoff` rounds (doubling up to
    # MAX_BACKOFF, reset by a drafted round that pays). Skipped rounds are plain decode steps through the same
    # verify path, so the output is unchanged.
    backoff = skip = 0

    # --- rounds -------------------------------------------------------------------------------------------------
    while not all(finished):
        limit = min(gamma, settings.verify_limit if settings.verify_limit is not None else gamma)
        room = [0 if finished[r] else min(limit, max_length - len(histories[r]) - 1) for r in range(R)]
        # a row whose recent tokens repeat earlier ones verifies what followed them instead of a drafted block, when
        # it is the only row running: in a batch every row shares the verify block's width, and lookups, which no
        # plan prices, widened it past what the scheduler pays for (R = 4: 58 tok/s against 67 scheduled)
        alone = lookup_on and sum(not f for f in finished) == 1
        looked = lookups(settings, histories, room) if alone else {}
        caps = [0 if skip or r in looked else room[r] for r in range(R)]
        skip = max(skip - 1, 0)
        stats.round_rows.append([batch_rows[r] for r in range(R) if not finished[r]])
        # the plan grows column by column as the draft's slots come; drafting stops at the first column it closes on
        planner = None
        if STOP_DRAFTING_EARLY:
            planner = column_plan(mode, settings.verify_layout, caps, planning, settings.confidence_threshold)
        early = planner is not None
        proposal = draft_block(
            draft, context, histories, anchor_pos, max(caps), logits_processor, do_sample,
            enough=(lambda column, planner=planner: not planner.admit(column)) if early else None,
        )  # fmt: skip
        if early:
            lengths = planner.lengths
        else:
            lengths = choose_lengths(
                mode, proposal.confidences, caps, conf_history, planning, settings.confidence_threshold,
                settings.verify_layout,
            )  # fmt: skip
        if proposal.confidences is not None and proposal.confidences.shape[1]:
            conf_history = [*conf_history[-1:], proposal.confidences.cpu()]
            if priced:
                active = [r for r in range(R) if not finished[r] and r not in looked]
                pays = drafting_pays(conf_history[-1][active], [lengths[r] for r in active], R, sps, drafting)
                backoff = 0 if pays else min(2 * backoff or 1, MAX_BACKOFF)
                skip = backoff
        for r, found in looked.items():
            lengths[r] = found.shape[0]
        stats.verify_rounds.append([lengths[r] for r in range(R) if not finished[r]])

        # verify: each active row's anchor + its ℓ_r draft tokens, one target forward for the whole batch
        W = max(lengths[r] + 1 for r in range(R) if not finished[r])
        proposed = [looked.get(r, proposal.tokens[r, : lengths[r]]) for r in range(R)]
        block = torch.full((R, W), pad_id, dtype=torch.long, device=device)
        slot_valid = torch.zeros(R, W, dtype=torch.bool, device=device)
        for r in range(R):
            if not finished[r]:
                block[r, 0] = histories[r][-1]
                block[r, 1 : 1 + lengths[r]] = proposed[r]
                slot_valid[r, : lengths[r] + 1] = True
        block_positions = anchor_pos[:, None] + torch.arange(W, device=device)
        full_mask = torch.cat([cache_mask, slot_valid.long()], dim=1)
        mask = None if bool(full_mask.all()) else full_mask
        out, fused = _target_forward(target, block, block_positions, mask, cache, tap)
        raw = out.logits.float() if out.logits.dtype != torch.float64 else out.logits
        _check_finite(raw[slot_valid])

        kept = torch.zeros(R, W, dtype=torch.bool, device=device)  # anchor + accepted: the new committed slots
        for r in range(R):
            if finished[r]:
                continue
            ell = lengths[r]
            if r in looked:  # a deterministic proposal: q is one-hot (greedy needs no q)
                q = one_hot_probs(proposed[r], raw.shape[-1]) if do_sample else None
            else:
                q = proposal.probs[r, :ell] if proposal.probs is not None else None
            n, nxt, target_scores = verify_row(
                proposed[r], q, raw[r, : ell + 1], histories[r], logits_processor, do_sample
            )
            new_tokens = torch.cat([proposed[r][:n], nxt[None]])
            # commit token by token so stopping criteria (EOS, max_length, stop strings) cut exactly where plain
            # generate would have stopped
            committed = 0
            for i in range(n + 1):
                histories[r] = torch.cat([histories[r], new_tokens[i : i + 1]])
                committed += 1
                if want_scores:
                    scores_out.append(target_scores[i : i + 1])
                if want_logits:
                    logits_out.append(raw[r, i : i + 1])
                if bool(stopping_criteria(histories[r][None], target_scores[i : i + 1]).any()):
                    finished[r] = True
                    break
            confs = None if proposal.confidences is None or r in looked else proposal.confidences[r, :ell].tolist()
            stats.record(ell, n, committed, confs, looked_up=r in looked)
            if streamer is not None:
                streamer.put(new_tokens[:committed].cpu())
            kept[r, : n + 1] = True
            anchor_pos[r] += n + 1
        if all(finished):
            break

        # keep committed slots, drop the columns that are holes in every row, extend the draft context alike
        used = int(kept.any(0).nonzero().max()) + 1
        cache.crop(-(W - used))
        cache_mask = torch.cat([cache_mask, kept[:, :used].long()], dim=1)
        context.extend(fused[:, :used], block_positions[:, :used], kept[:, :used])

        if compact and any(finished):
            keep = [r for r in range(R) if not finished[r]]
            done.update({batch_rows[r]: histories[r] for r in range(R) if finished[r]})
            idx = torch.tensor(keep, device=device)
            cache.batch_select_indices(idx)
            context.select(idx)
            cache_mask, anchor_pos = cache_mask[idx], anchor_pos[idx]
            conf_history = [c[idx.cpu()] for c in conf_history]
            histories, batch_rows = [histories[r] for r in keep], [batch_rows[r] for r in keep]
            R, finished = len(keep), [False] * len(keep)
            if priced:
                sps, drafting, planning = _prices(draft, target, profile_rows(R, input_ids.shape[0]), do_sample)

    if streamer is not None:
        streamer.end()
    done.update(zip(batch_rows, histories, strict=True))
    histories = [done[r] for r in range(input_ids.shape[0])]
    width = max(len(h) for h in histories)
    sequences = torch.full((len(histories), width), pad_id, dtype=torch.long, device=device)
    for r, h in enumerate(histories):
        sequences[r, : len(h)] = h
    draft.stats = stats  # the last call to finish; its own stats come back on a dict output
    if generation_config.return_dict_in_generate:
        return DSparkGenerateOutput(
            sequences=sequences,
            scores=tuple(scores_out) if want_scores else None,
            logits=tuple(logits_out) if want_logits else None,
            dspark_stats=stats,
            **{CACHE_FIELD: cache},
        )
    return sequences
