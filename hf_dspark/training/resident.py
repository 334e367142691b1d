"""Target features held on the training device, and a training loop that runs on the wall clock.

On a GPU the frozen target's forward, the host-side batch assembly and the per-chunk vocabulary statistics cost a
step more than the draft's own forward and backward (docs/training.md, "On a borrowed GPU"). Here the target runs
once per sequence, up front, in one batched pass over all rows (:meth:`ResidentFeatures.compute`); what the losses
read (the injected layers' hidden states, the final hidden state, and the whole-vocabulary log-normaliser and
argmax at every position) stays in device memory, flat, and a step gathers its batch from it with indexing alone:
no target forward, no host-to-device copy, no Python loop over rows or chunks, no host sync
(:meth:`ResidentFeatures.sample`).

:func:`train_for` trains a draft for a wall-clock budget: the learning rate is a function of elapsed time over the
budget (warmup, then cosine), the deadline is read every step, and every ``milestone_seconds`` the held-out τ proxy
is measured and the best weights so far are handed to a callback (written to disk by the caller), so a run cut off
at any point still leaves a usable draft.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..model.modeling_dspark import DSparkDraftModel
from .features import target_outputs, target_statistics
from .losses import DSparkTrainingModule, LossWeights


@dataclass
class ResidentBatch:
    """One step's batch, every tensor on the device: ``input_ids`` [B, L], ``valid`` [B, L], ``anchors`` [B, A],
    ``features`` [B, L, m·d_t], ``final`` [B, L, d_t], ``stats`` (logsumexp [B, L], argmax [B, L]) and
    ``target_wrote`` [B] (the arguments of :class:`~.losses.DSparkTrainingModule`)."""

    input_ids: torch.Tensor
    valid: torch.Tensor
    anchors: torch.Tensor
    features: torch.Tensor
    final: torch.Tensor
    stats: tuple[torch.Tensor, torch.Tensor]
    target_wrote: torch.Tensor

    def losses(self, module: DSparkTrainingModule) -> dict[str, torch.Tensor]:
        return module(self.features, self.input_ids, self.valid, self.anchors, self.final, self.stats,
                      self.target_wrote)  # fmt: skip


@dataclass
class ResidentFeatures:
    """Every row's target outputs, concatenated along one token axis of N positions (row r holds positions
    ``starts[r] : starts[r] + lengths[r]``; rows are sorted by length, shortest first).

    ``ids`` [N], ``features`` [N, m·d_t], ``final`` [N, d_t] (the target's dtype), ``logsumexp`` [N] float32,
    ``argmax`` [N]; per row [R]: ``starts``, ``lengths``, ``first_anchor`` (the last prompt token: a block anchored
    there predicts the answer's first token), ``target_wrote``. ``buckets``: (first row, end row, longest length)
    over consecutive rows of similar length, so a batch pads to its bucket's length, not the longest row's."""

    ids: torch.Tensor
    features: torch.Tensor
    final: torch.Tensor
    logsumexp: torch.Tensor
    argmax: torch.Tensor
    starts: torch.Tensor
    lengths: torch.Tensor
    first_anchor: torch.Tensor
    target_wrote: torch.Tensor
    buckets: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return int(self.starts.numel())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ids, self.features, self.final, self.logsumexp,
                                                          self.argmax))  # fmt: skip

    @classmethod
    @torch.no_grad()
    def compute(
        cls,
        target,
        layer_ids: list[int],
        rows: list[dict],
        max_length: int = 768,
        batch_tokens: int = 65536,
        buckets: int = 8,
    ) -> ResidentFeatures:
        """Run ``target`` once over every row (``prompt_ids + response_ids``, cut to ``max_length``; rows shorter
        than 3 tokens hold no block and are dropped), in padded batches of about ``batch_tokens`` tokens of similar
        length, on the target's device and in its dtype; keep what the losses read, flat, on that device."""
        seqs = [((r["prompt_ids"] + r["response_ids"])[:max_length], r) for r in rows]
        seqs = sorted((s for s in seqs if len(s[0]) >= 3), key=lambda s: len(s[0]))
        if not seqs:
            raise ValueError("no row holds a block (every row is shorter than 3 tokens)")
        device, dtype = target.device, target.dtype
        lengths = torch.tensor([len(s) for s, _ in seqs])
        starts = torch.cumsum(lengths, 0) - lengths
        total, width = int(lengths.sum()), target.config.get_text_config().hidden_size
        ids = torch.tensor([t for s, _ in seqs for t in s], device=device)
        features = torch.empty(total, width * len(layer_ids), device=device, dtype=dtype)
        final = torch.empty(total, width, device=device, dtype=dtype)
        logsumexp = torch.empty(total, device=device)
        argmax = torch.empty(total, dtype=torch.long, device=device)
        head = target.get_output_embeddings()
        i = 0
        while i < len(seqs):
            longest = len(seqs[i][0])
            j = i
            while j < len(seqs) and (j - i + 1) * max(longest, len(seqs[j][0])) <= max(batch_tokens, longest):
                longest = max(longest, len(seqs[j][0]))
                j += 1
            batch = [s for s, _ in seqs[i:j]]
            x = torch.zeros(len(batch), longest, dtype=torch.long)
            valid = torch.zeros(len(batch), longest, dtype=torch.bool)
            for b, s in enumerate(batch):  # built on the host, moved in one copy per batch
                x[b, : len(s)] = torch.tensor(s)
                valid[b, : len(s)] = True
            x, valid = x.to(device), valid.to(device)
            feats, hidden = target_outputs(target, layer_ids, x, valid)
            at = int(starts[i])
            n = int(valid.sum())
            features[at : at + n] = feats[valid].to(dtype)
            final[at : at + n] = hidden[valid].to(dtype)
            lse, top = target_statistics(head, final[at : at + n].to(head.weight.dtype), chunk=8192)
            logsumexp[at : at + n], argmax[at : at + n] = lse, top
            i = j
        prompt = torch.tensor([len(r["prompt_ids"]) for _, r in seqs])
        first = torch.clamp(torch.minimum(prompt, lengths - 2) - 1, min=1)  # as trainer.make_batch anchors
        wrote = torch.tensor([r.get("target_wrote", True) for _, r in seqs], dtype=torch.bool)
        bounds = sorted({round(k * len(seqs) / buckets) for k in range(buckets + 1)})
        spans = [(a, b, int(lengths[b - 1])) for a, b in itertools.pairwise(bounds) if b > a]
        return cls(ids, features, final, logsumexp, argmax, starts.to(device), lengths.to(device),
                   first.to(device), wrote.to(device), spans)  # fmt: skip

    def sample(self, batch_size: int, anchors: int, rng: random.Random, generator: torch.Generator) -> ResidentBatch:
        """A batch of ``batch_size`` rows (a bucket drawn on the host by ``rng`` in proportion to its rows, rows
        within it and ``anchors`` anchors per row drawn on the device by ``generator``) gathered from the resident
        tensors: every row uniformly likely, anchors uniform in [first anchor, length - 1) as
        :func:`~.trainer.make_batch` draws them. Launches kernels only: no host sync, no copy."""
        lo, hi, width = rng.choices(self.buckets, weights=[b - a for a, b, _ in self.buckets])[0]
        device = self.ids.device
        picked = torch.randint(lo, hi, (batch_size,), device=device, generator=generator)
        length = self.lengths[picked]
        offsets = torch.arange(width, device=device)
        valid = offsets[None, :] < length[:, None]
        index = self.starts[picked][:, None] + torch.minimum(offsets[None, :], length[:, None] - 1)
        first = self.first_anchor[picked][:, None]
        span = (length[:, None] - 1 - first).clamp_min(1)
        draws = torch.rand(batch_size, anchors, device=device, generator=generator)
        anchor = first + (draws * span).long().clamp_max(span - 1)
        input_ids = torch.where(valid, self.ids[index], 0)
        stats = (self.logsumexp[index], self.argmax[index])
        return ResidentBatch(input_ids, valid, anchor, self.features[index], self.final[index], stats,
                             self.target_wrote[picked])  # fmt: skip

    def fixed_batches(self, count: int, batch_size: int, anchors: int, seed: int = 1234) -> list[ResidentBatch]:
        """``count`` batches drawn once with a fixed seed: the same blocks for every evaluation of a run."""
        rng, generator = random.Random(seed), torch.Generator(self.ids.device).manual_seed(seed)
        return [self.sample(batch_size, anchors, rng, generator) for _ in range(count)]


def tau_proxy(accept: list[float]) -> float:
    """1 + Σ_k Π_{j≤k} a_k over per-slot greedy acceptances a_k: the draft-alone τ of a fixed block if slots were
    accepted independently (as ``benchmarks/tokens_curve.py`` reports it)."""
    tau, keep = 1.0, 1.0
    for a in accept:
        keep *= a
        tau += keep
    return tau


@torch.no_grad()
def heldout_proxy(module: DSparkTrainingModule, batches: list[ResidentBatch], autocast) -> dict:
    """Per-slot greedy acceptance over ``batches`` (teacher-forced held-out blocks: the draft's argmax against the
    target's) and its τ proxy, the module in eval mode for the measurement."""
    was_training = module.training
    module.eval()
    totals = None
    for batch in batches:
        with autocast():
            out = batch.losses(module)
        per_slot = out["greedy_accept"].float()
        totals = per_slot if totals is None else totals + per_slot
    module.train(was_training)
    accept = (totals / len(batches)).tolist()
    return {"slot_accept": [round(a, 4) for a in accept], "tau_proxy": round(tau_proxy(accept), 4)}


@dataclass
class ClockTraining:
    """Optimisation on the wall clock: ``lr`` peaks after ``warmup`` of the budget and decays (cosine) to
    ``min_lr_ratio`` of it at the deadline; ``batch_size`` rows × ``anchors`` blocks per step."""

    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: float = 0.03
    batch_size: int = 32
    anchors: int = 96
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    loss_weights: LossWeights = field(default_factory=LossWeights)
    seed: int = 0
    log_every: int = 50
    milestone_seconds: float = 120.0
    heldout_batches: int = 8
    bf16_autocast: bool = True

    def lr_factor(self, elapsed: float) -> float:
        """The learning rate's multiple at ``elapsed`` ∈ [0, 1] of the budget."""
        if elapsed < self.warmup:
            return max(elapsed / self.warmup, 1e-3)
        t = min((elapsed - self.warmup) / max(1 - self.warmup, 1e-9), 1.0)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))


@dataclass
class ClockResult:
    """What :func:`train_for` did: ``steps``, ``blocks`` (rows × anchors over all steps), ``seconds`` training,
    the held-out proxy at the start, at every milestone and at the end, and the best one (whose weights were
    handed out last)."""

    steps: int = 0
    blocks: int = 0
    seconds: float = 0.0
    start: dict = field(default_factory=dict)
    milestones: list[dict] = field(default_factory=list)
    best: dict = field(default_factory=dict)


def train_for(
    draft: DSparkDraftModel,
    train: ResidentFeatures,
    heldout: ResidentFeatures,
    cfg: ClockTraining,
    seconds: float,
    vocab: torch.Tensor | None,
    keep: Callable[[DSparkDraftModel, dict], None],
    log: Callable[[dict], None] = print,
    max_steps: int | None = None,
) -> ClockResult:
    """Train ``draft`` (attached to its frozen target) on ``train`` for ``seconds`` of wall clock, over the draft
    vocabulary ``vocab`` (``None``: the whole one). The held-out τ proxy is measured at the start, every
    ``cfg.milestone_seconds`` and at the end; each time it beats the best so far, ``keep(draft, proxy)`` is called
    with the weights as they are then (the start counts: a run that never improves hands out its starting
    weights). ``max_steps`` also ends the run after that many steps, the schedule then following whichever budget
    is further spent (an A/B at equal steps). Returns a :class:`ClockResult`; ``draft`` holds the last step's
    weights."""
    device = train.ids.device
    module = DSparkTrainingModule(draft, cfg.loss_weights, vocab).to(device)
    params = [p for p in module.parameters() if p.requires_grad]
    # fused: one optimizer kernel for all parameters
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95), fused=True)
    # float32 master weights; a bfloat16 target's embedding and LM head (which the draft borrows) run under autocast
    use_bf16 = cfg.bf16_autocast and train.features.dtype == torch.bfloat16

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)

    probe = heldout.fixed_batches(cfg.heldout_batches, min(cfg.batch_size, 8), cfg.anchors)
    result = ClockResult()
    result.start = result.best = {"seconds": 0.0, "step": 0, **heldout_proxy(module, probe, autocast)}
    keep(draft, result.best)
    log({"event": "start", **result.start})
    rng, generator = random.Random(cfg.seed), torch.Generator(device).manual_seed(cfg.seed)
    module.train()
    begin = time.monotonic()
    last_milestone = begin
    while True:
        now = time.monotonic()
        if now - begin >= seconds or (max_steps is not None and result.steps >= max_steps):
            break
        spent = (now - begin) / seconds if seconds > 0 else 1.0
        factor = cfg.lr_factor(max(spent, result.steps / max_steps if max_steps else 0.0))
        for group in opt.param_groups:
            group["lr"] = cfg.lr * factor
        batch = train.sample(cfg.batch_size, cfg.anchors, rng, generator)
        with autocast():
            out = batch.losses(module)
        out["loss"].backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        result.steps += 1
        if result.steps % cfg.log_every == 0:  # the only host reads of a step, every log_every steps
            elapsed = time.monotonic() - begin
            log({"step": result.steps, "seconds": round(elapsed, 1), "lr": cfg.lr * factor,
                 "s_per_step": round(elapsed / result.steps, 4),
                 **{k: round(float(v.detach()), 4) for k, v in out.items() if v.dim() == 0},
                 "greedy_accept": [round(a, 3) for a in out["greedy_accept"].tolist()]})  # fmt: skip
        if time.monotonic() - last_milestone >= cfg.milestone_seconds:
            _milestone(module, probe, autocast, result, begin, keep, log)
            last_milestone = time.monotonic()
    result.seconds = time.monotonic() - begin
    result.blocks = result.steps * cfg.batch_size * cfg.anchors
    _milestone(module, probe, autocast, result, begin, keep, log)
    return result


def _milestone(module, probe, autocast, result: ClockResult, begin: float, keep, log) -> None:
    """Measure the held-out proxy now; hand the weights to ``keep`` when they beat the best so far."""
    point = {"seconds": round(time.monotonic() - begin, 1), "step": result.steps,
             **heldout_proxy(module, probe, autocast)}  # fmt: skip
    result.milestones.append(point)
    better = point["tau_proxy"] > result.best["tau_proxy"]
    if better:
        result.best = point
        keep(module.draft, point)
    log({"event": "milestone", "kept": better, **point})
