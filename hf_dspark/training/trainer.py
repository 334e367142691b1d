"""DSpark draft training on `accelerate`: one code path for one CPU process and for many GPUs (DDP).

Target features are computed online (the target runs frozen, under no_grad, beside the draft). Every step's batch
and anchors come from a generator seeded by (seed, step, rank), so a resumed run draws exactly what an
uninterrupted one would. Checkpoints are written to a temporary folder and renamed into place: an interrupted
save never leaves a corrupt checkpoint.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..model.modeling_dspark import DSparkDraftModel
from .features import FeatureCache, target_outputs
from .losses import DSparkTrainingModule, LossWeights


@dataclass
class TrainConfig:
    """Optimisation settings. ``batch_size`` sequences per process per step, ``anchors`` random blocks each."""

    steps: int = 1000
    lr: float = 6e-4
    layers_lr_scale: float = 1.0  # the decoder layers' lr is lr * this (they start as copies of the target's)
    min_lr_ratio: float = 0.1
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    batch_size: int = 1
    anchors: int = 32
    max_length: int = 1024
    grad_clip: float = 1.0
    seed: int = 0
    save_every: int = 100
    log_every: int = 10
    keep_checkpoints: int = 2
    milestone_every: int = 0  # checkpoints at multiples of this are never pruned (a learning curve reads them)
    loss_weights: LossWeights = field(default_factory=LossWeights)
    mixed_precision: str = "no"


def _lr_lambda(cfg: TrainConfig):
    warm = max(1, int(cfg.steps * cfg.warmup_ratio))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        t = (step - warm) / max(1, cfg.steps - warm)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))

    return f


def parameter_groups(module: torch.nn.Module, draft: DSparkDraftModel, cfg: TrainConfig) -> list[dict]:
    """The optimizer's parameter groups: the draft's decoder layers at ``lr * cfg.layers_lr_scale``, everything else
    that trains (fusion, heads, norms, the mask embedding) at ``lr``. One group when the scale is 1. ``LambdaLR``
    scales each group's own initial lr, so the ratio holds through warmup and decay."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    if cfg.layers_lr_scale == 1.0:
        return [{"params": trainable}]
    if cfg.layers_lr_scale <= 0:
        raise ValueError(f"layers_lr_scale must be positive, got {cfg.layers_lr_scale}")
    in_layers = {id(p) for p in draft.layers.parameters()}
    layers = [p for p in trainable if id(p) in in_layers]
    rest = [p for p in trainable if id(p) not in in_layers]
    return [{"params": rest}, {"params": layers, "lr": cfg.lr * cfg.layers_lr_scale}]


def batch_generator(cfg: TrainConfig, step: int, rank: int = 0) -> torch.Generator:
    """The generator that draws step ``step``'s batch and anchors on process ``rank``: a function of (seed, step,
    rank) alone, so a resumed run (or a benchmark counting a run's positions) draws exactly what the run draws."""
    return torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1009 + rank)


def make_batch(rows: list[dict], cfg: TrainConfig, gen: torch.Generator, pad_id: int = 0):
    """Pick ``batch_size`` sequences and ``anchors`` anchors in each answer -> (input_ids, valid, anchors, rows)."""
    idx = torch.randint(len(rows), (cfg.batch_size,), generator=gen).tolist()
    seqs = [(rows[i]["prompt_ids"] + rows[i]["response_ids"])[: cfg.max_length] for i in idx]
    starts = [min(len(rows[i]["prompt_ids"]), len(s) - 2) for i, s in zip(idx, seqs, strict=True)]
    L = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    valid = torch.zeros(len(seqs), L, dtype=torch.bool)
    anchors = torch.zeros(len(seqs), cfg.anchors, dtype=torch.long)
    for r, (s, start) in enumerate(zip(seqs, starts, strict=True)):
        input_ids[r, : len(s)] = torch.tensor(s)
        valid[r, : len(s)] = True
        # anchors: the last prompt token onwards (the first block predicts the answer's first token)
        lo, hi = max(start - 1, 1), len(s) - 1
        anchors[r] = torch.randint(lo, hi, (cfg.anchors,), generator=gen)
    return input_ids, valid, anchors, idx


def text_by_target(rows: list[dict], idx: list[int], device=None) -> torch.Tensor:
    """[R] bool: whether the target wrote each batch row's answer (a row says ``"target_wrote": false`` when it
    did not, as reference answers do; regenerated rows need not say)."""
    return torch.tensor([rows[i].get("target_wrote", True) for i in idx], dtype=torch.bool, device=device)


def batch_target_outputs(target, draft, rows, idx, input_ids, valid, cache: FeatureCache | None, cfg):
    """(features [R, L, m·d_t], final hidden [R, L, d_t], statistics) for a batch: from the cache row by row, with
    the target's per-position (logsumexp, argmax) [R, L] as statistics, or online with ``None`` (the loss then
    computes them at the slots it needs)."""
    if cache is None:
        return *target_outputs(target, draft.config.target_layer_ids, input_ids, valid), None
    got = [cache.get(rows[i], cfg.max_length, input_ids.device) for i in idx]
    R, L = input_ids.shape
    feats = torch.zeros(R, L, got[0][0].shape[-1], device=input_ids.device, dtype=draft.dtype)
    final = torch.zeros(R, L, got[0][1].shape[-1], device=input_ids.device, dtype=draft.dtype)
    lse = torch.zeros(R, L, device=input_ids.device)
    top = torch.zeros(R, L, dtype=torch.long, device=input_ids.device)
    for r, row in enumerate(got):
        n = row[0].shape[0]
        feats[r, :n], final[r, :n], lse[r, :n], top[r, :n] = row
    return feats, final, (lse, top)


VOCAB_FILE = "draft_vocab.json"


def saved_vocab(out_dir: str | Path) -> torch.Tensor | None:
    """The draft vocabulary a run in ``out_dir`` trains over (``draft_vocab.json``), or ``None`` if it has none."""
    path = Path(out_dir) / VOCAB_FILE
    return torch.tensor(json.loads(path.read_text()), dtype=torch.long) if path.is_file() else None


def _check_vocab(out_dir: Path, vocab: torch.Tensor | None, write: bool) -> None:
    """A run keeps its draft vocabulary once it has one: the first start given ids writes them (``write``: the main
    process; a whole-vocabulary run may switch to one when resumed), and every later start must be given the same
    ids. Every process checks, so a refused resume stops all of them, not the main one alone."""
    saved = saved_vocab(out_dir)
    if saved is not None and (vocab is None or not torch.equal(saved.sort().values, vocab.sort().values)):
        raise ValueError(
            f"{out_dir} holds a run trained over the {saved.numel()}-token draft vocabulary in {VOCAB_FILE}: "
            "resume it with those ids (training.trainer.saved_vocab) or start a new run folder"
        )
    if saved is None and vocab is not None and write:
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / (VOCAB_FILE + ".tmp")
        tmp.write_text(json.dumps(vocab.tolist()))
        tmp.replace(out_dir / VOCAB_FILE)


def _latest_checkpoint(out_dir: Path) -> Path | None:
    ckpts = sorted(out_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return ckpts[-1] if ckpts else None


def train(
    target,
    draft: DSparkDraftModel,
    rows: list[dict],
    out_dir: str | Path,
    cfg: TrainConfig,
    accelerator=None,
    progress: bool = True,
    log=print,
    stop_at: int | None = None,
    feature_cache: str | Path | None = None,
    vocab: torch.Tensor | list[int] | None = None,
) -> DSparkDraftModel:
    """Train ``draft`` (attached to the frozen ``target``) on regenerated ``rows``; resume from ``out_dir``.

    Writes ``checkpoint-<step>/`` (accelerate state + ``step.json``) every ``save_every`` steps and the final
    draft (``save_pretrained``) to ``out_dir/final``. ``stop_at`` ends this run early at that step (after saving a
    checkpoint) without changing the schedule, so a later call resumes as if never stopped. ``feature_cache``, a
    folder, stores the target's features per row so later epochs skip the target forward. ``vocab`` (token ids)
    trains over that draft vocabulary only (see :class:`DSparkTrainingModule`; ship the draft with
    ``set_draft_vocab(vocab)``). The ids are kept in ``out_dir/draft_vocab.json``; resuming with other ids (or
    none) raises ``ValueError``, and the final draft is saved with them as its draft vocabulary. Returns the draft.
    """
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    out_dir = Path(out_dir)
    acc = accelerator or Accelerator(mixed_precision=cfg.mixed_precision)
    target.requires_grad_(False).eval()
    draft.train()
    module = DSparkTrainingModule(draft, cfg.loss_weights, vocab)
    # fused: one kernel per step instead of a dozen elementwise passes over every parameter (15% of a CPU step)
    groups = parameter_groups(module, draft, cfg)
    params = [p for group in groups for p in group["params"]]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95), fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg))
    module, opt, sched = acc.prepare(module, opt, sched)
    target.to(acc.device)
    cache = FeatureCache(feature_cache, target, draft.config.target_layer_ids) if feature_cache else None

    start = 0
    latest = _latest_checkpoint(out_dir)
    vocab = None if vocab is None else torch.as_tensor(vocab, dtype=torch.long).flatten()
    _check_vocab(out_dir, vocab, write=acc.is_main_process)
    if latest is not None:
        saved = json.loads((latest / "step.json").read_text())
        # the optimizer state holds one group per learning rate; checkpoints older than the setting trained at 1.0
        scale = saved.get("layers_lr_scale", 1.0)
        if scale != cfg.layers_lr_scale:
            raise ValueError(
                f"{latest} was trained with layers_lr_scale={scale}, not {cfg.layers_lr_scale}: resume it with the "
                "same setting or start a new run folder"
            )
        acc.load_state(str(latest))
        start = saved["step"]
        log(f"resumed from {latest} at step {start}")

    end = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
    bar = tqdm(range(start, end), disable=not (progress and acc.is_main_process), desc="train")
    t0 = time.time()
    for step in bar:
        input_ids, valid, anchors, idx = make_batch(rows, cfg, batch_generator(cfg, step, acc.process_index))
        input_ids, valid, anchors = input_ids.to(acc.device), valid.to(acc.device), anchors.to(acc.device)
        feats, final, stats = batch_target_outputs(target, draft, rows, idx, input_ids, valid, cache, cfg)
        with acc.autocast():
            out = module(feats, input_ids, valid, anchors, final, stats, text_by_target(rows, idx, acc.device))
        acc.backward(out["loss"])
        if cfg.grad_clip:
            acc.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if acc.is_main_process and (step + 1) % cfg.log_every == 0:
            rec = {k: round(float(v.detach()), 4) for k, v in out.items() if v.dim() == 0}
            rec.update(
                step=step + 1, lr=sched.get_last_lr()[0], s_per_step=round((time.time() - t0) / (step + 1 - start), 3)
            )
            rec["greedy_accept"] = [round(x, 3) for x in out["greedy_accept"].tolist()]
            log(json.dumps(rec))
            bar.set_postfix(loss=rec["loss"])
        if (step + 1) % cfg.save_every == 0 or step + 1 == end:
            meta = {"layers_lr_scale": cfg.layers_lr_scale}
            save_checkpoint(acc, out_dir, step + 1, cfg.keep_checkpoints, cfg.milestone_every, meta)
    final = acc.unwrap_model(module).draft
    if vocab is not None and end == cfg.steps:  # the finished draft decodes over what it was trained on
        final.set_draft_vocab(vocab)
    if acc.is_main_process and end == cfg.steps:
        final.save_pretrained(out_dir / "final")
        (out_dir / "final" / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2))
    acc.wait_for_everyone()
    return final


def save_checkpoint(
    acc, out_dir: Path, step: int, keep: int, milestone_every: int = 0, meta: dict | None = None
) -> Path:
    """Atomic: save into ``.tmp-checkpoint-<step>`` then rename; prune to the ``keep`` newest, sparing steps that
    are multiples of ``milestone_every`` (when > 0). ``step.json`` holds the step and ``meta`` (settings a resume
    must match)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / f"checkpoint-{step}"
    tmp = out_dir / f".tmp-checkpoint-{step}"
    if acc.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    acc.wait_for_everyone()
    acc.save_state(str(tmp))
    # every process writes its own RNG state into tmp, and save_state does not wait: rename only once all have
    acc.wait_for_everyone()
    if acc.is_main_process:
        (tmp / "step.json").write_text(json.dumps({"step": step, **(meta or {})}))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        ckpts = sorted(out_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        for old in ckpts[:-keep]:
            if not (milestone_every and int(old.name.split("-")[1]) % milestone_every == 0):
                shutil.rmtree(old)
    acc.wait_for_everyone()
    return final
