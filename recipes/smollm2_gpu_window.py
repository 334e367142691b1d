"""Continue training the shipped SmolLM2 draft on a borrowed GPU, inside one device call, and ship what comes back.

    python -m recipes.smollm2_gpu_window run --out $OUT [--seconds 480]        # there, after the GGUF's parts
    python -m recipes.smollm2_gpu_window ship FILES_AT [--run NAME] [--out DIR] # here: unpack, then smollm2_ship

``run`` warm-starts the shipped draft (its layers, vocabulary, head rank: ``--init``), computes the target's
features for every committed answer once, on the device (:class:`~hf_dspark.training.resident.ResidentFeatures`),
and trains on the wall clock until ``--seconds`` after the command began, less ``--reserve`` for the last
evaluation (:func:`~hf_dspark.training.resident.train_for`). Before training and at the end it measures the
held-out τ proxy (teacher-forced blocks of the recipe's held-out answers, never trained on) and the draft-alone
greedy τ on a few evaluation prompts of each set (fixed γ = 8, lookup off), and ``summary`` says whether the new
weights beat the starting ones.

What comes back, in ``--out`` (8 files at most, each < 16 MiB): the best weights so far in bfloat16 as safetensors
shards in one of two slots (``weights-a-*`` / ``weights-b-*``: a milestone writes the slot not in use, then
``milestone.json`` names it with each file's SHA-256, so a command killed at any moment leaves a whole draft),
``milestone.json`` (which slot, the starting draft's config hash, the plan, the evaluations; the whole summary at
the end) and ``log.jsonl``. No answers are regenerated: the committed shards are the data.

``ship`` checks and unpacks those files into ``<state>/<run>/`` (final draft, ``train_config.json``,
``recipe.json`` continuing the shipped draft's history, ``log.jsonl``, ``draft_vocab.json``), then runs
``recipes/smollm2_ship.py`` on it: STS refitted in bfloat16 decoding, the card rendered (then ``hf-dspark eval`` and
``bench`` into the same folder and ``hf-dspark card`` again, as for a CPU-trained draft: docs/training.md).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hf_dspark import DSparkDraftModel, dspark_generate
from hf_dspark.embedded import DRAFT_DIR
from hf_dspark.evaluation.evaluate import chat_ids, load_prompts
from hf_dspark.training.data import left_pad, load_dataset
from hf_dspark.training.losses import LossWeights
from hf_dspark.training.resident import ClockTraining, ResidentFeatures, train_for
from recipes.smollm2_gpu_oneshot import FILE_LIMIT, MAX_FILES, PARTS, sha256, target_gguf
from recipes.smollm2_prepare import ANSWERS
from recipes.smollm2_train import STATE, is_held_out, shipped_runs

SLOT_FILES = 3  # weight shards per slot: two slots, milestone.json and log.jsonl make MAX_FILES
SHARD_BYTES = FILE_LIMIT - 2**20  # under the 16 MiB a file may have, with room for the safetensors header
SHIPPED_BLOCKS = 21_000 * 96  # what the shipped draft trained on: 21,000 steps of 1 sequence × 96 anchors
EVAL_SETS = ("humaneval", "gsm8k", "mt-bench")


def window_training() -> ClockTraining:
    """The window's optimisation: a warm restart (peak lr 1e-3, a third of the first run's 3e-3), 32 sequences ×
    96 anchors a step; the paper's loss, which the A/B of warm restarts at equal steps chose
    (benchmarks/results/training/window_loss_ab/; ``--loss`` picks the other)."""
    return ClockTraining(lr=1e-3, batch_size=32, anchors=96, loss_weights=LOSSES["paper"])


LOSSES = {  # the two candidates of the A/B (docs/training.md, "The window's loss")
    "ce-heavy": LossWeights(ce=1.0, tv=0.1, conf=1.0),  # the CPU recipe's: learned fastest on a tiny budget
    "paper": LossWeights(ce=0.1, tv=0.9, conf=1.0),  # DSpark's: TV is what acceptance measures
}


def config_hash(folder: Path) -> str:
    """SHA-256 of a draft folder's ``config.json``: weights that come back must fit the config they left with."""
    return sha256(folder / "config.json")


def shard(state: dict[str, torch.Tensor], limit: int = SHARD_BYTES) -> list[dict[str, torch.Tensor]]:
    """``state`` split, in key order, into groups of at most ``limit`` bytes each (a tensor larger than ``limit``
    raises: no shard could hold it)."""
    groups, size = [{}], 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > limit:
            raise ValueError(f"{name} alone is {nbytes / 2**20:.1f} MiB, over the {limit / 2**20:.1f} MiB a file holds")
        if size + nbytes > limit and groups[-1]:
            groups.append({})
            size = 0
        groups[-1][name] = tensor
        size += nbytes
    return groups


class Milestones:
    """The best weights so far in ``out``, in two slots used in turn; ``milestone.json`` names the slot that is
    whole (written last, through a temporary file), with the SHA-256 of each of its files."""

    def __init__(self, out: Path, init: Path, plan: dict):
        self.out, self.slot, self.best = out, None, None
        self.record = {"init": str(init), "config_sha256": config_hash(init), "plan": plan}
        out.mkdir(parents=True, exist_ok=True)

    def keep(self, draft: DSparkDraftModel, point: dict) -> None:
        """Write ``draft``'s weights (bfloat16, as shipped) into the slot not in use, then point the record at it."""
        state = {k: v.detach().to("cpu", torch.bfloat16 if v.is_floating_point() else v.dtype).contiguous()
                 for k, v in draft.state_dict().items()}  # fmt: skip
        groups = shard(state)
        if len(groups) > SLOT_FILES:
            raise ValueError(f"the draft needs {len(groups)} files of < 16 MiB; a slot holds {SLOT_FILES}")
        slot = "b" if self.slot == "a" else "a"
        for old in self.out.glob(f"weights-{slot}-*.safetensors"):
            old.unlink()
        files = {}
        for k, group in enumerate(groups):
            path = self.out / f"weights-{slot}-{k}.safetensors"
            save_file(group, str(path))
            files[path.name] = sha256(path)
        self.slot, self.best = slot, state
        self.update(slot=slot, files=files, best=point)

    def update(self, **fields) -> None:
        """Merge ``fields`` into ``milestone.json`` (atomically)."""
        self.record.update(fields)
        tmp = self.out / "milestone.json.tmp"
        tmp.write_text(json.dumps(self.record, indent=1))
        tmp.replace(self.out / "milestone.json")


def check_outputs(out: Path) -> list[str]:
    """What is wrong with ``out`` as the files a device call brings back (empty: nothing)."""
    files = [p for p in out.rglob("*") if p.is_file()]
    problems = [f"{len(files)} files (at most {MAX_FILES})"] if len(files) > MAX_FILES else []
    big = [f"{p.name} is {p.stat().st_size / 2**20:.1f} MiB" for p in files if p.stat().st_size >= FILE_LIMIT]
    return problems + big


@torch.no_grad()
def greedy_tau(target, tokenizer, draft: DSparkDraftModel, per_set: int, max_new_tokens: int,
               sets: tuple[str, ...] = EVAL_SETS) -> dict:  # fmt: skip
    """Draft-alone greedy τ (fixed γ, lookup off, a chain) on the first ``per_set`` prompts of each of ``sets``,
    each set one left-padded batch, on a bfloat16 copy of ``draft`` (the draft being trained keeps its float32
    weights)."""
    deployed = DSparkDraftModel(draft.config).to(target.dtype)  # a copy (deepcopy would copy the target it borrows)
    deployed.load_state_dict(draft.state_dict())
    deployed.decoding = draft.decoding.replace()
    deployed = deployed.attach(target).eval()
    pad = tokenizer.pad_token_id
    taus = {}
    for name in sets:
        prompts = [chat_ids(tokenizer, text)[0].tolist() for text in load_prompts(name, per_set)]
        ids, mask = left_pad(prompts, pad)
        out = target.generate(input_ids=ids.to(target.device), attention_mask=mask.to(target.device),
                              custom_generate=dspark_generate, draft=deployed, max_new_tokens=max_new_tokens,
                              do_sample=False, pad_token_id=pad, verify_mode="fixed", lookup_max_ngram=0, tree_top_k=1,
                              return_dict_in_generate=True)  # fmt: skip
        taus[name] = round(out.dspark_stats.tau, 3)
    return taus


def run(args) -> dict:
    """The device side: load, warm-start, compute features, evaluate, train on the clock, evaluate, summarise."""
    started = time.time()
    out = args.out
    gguf = target_gguf(args.parts_dir, args.gguf)
    from hf_dspark.embedded import fast_dtype, load_target

    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else fast_dtype()  # a CPU rehearsal: bf16 only with bf16 units
    target, tokenizer = load_target(dtype, gguf)
    target.to(device)
    draft = DSparkDraftModel.from_pretrained(args.init).attach(target).float()  # float32 master weights
    cfg = replace(window_training(), batch_size=args.batch_size, anchors=args.anchors, lr=args.lr,
                  loss_weights=LOSSES[args.loss], milestone_seconds=args.milestone_seconds,
                  heldout_batches=args.heldout_batches, log_every=args.log_every)  # fmt: skip
    plan = {"seconds": args.seconds, "reserve": args.reserve, "loss": args.loss, **asdict(cfg), "rows": args.rows,
            "max_length": args.max_length, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "dtype": str(dtype).removeprefix("torch."),
            "torch": torch.__version__}  # fmt: skip
    milestones = Milestones(out, args.init, plan)
    log_path = out / "log.jsonl"

    def log(record: dict) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        with log_path.open("a") as f:
            f.write(line + "\n")

    answers = load_dataset(ANSWERS)
    train_rows = [r for r in answers if not is_held_out(r)][: args.rows]
    held_rows = [r for r in answers if is_held_out(r)][: args.heldout_rows]
    t0 = time.time()
    layers = draft.config.target_layer_ids
    train = ResidentFeatures.compute(target, layers, train_rows, args.max_length)
    heldout = ResidentFeatures.compute(target, layers, held_rows, args.max_length)
    log({"event": "features", "seconds": round(time.time() - t0, 1), "rows": train.rows, "tokens": train.ids.numel(),
         "heldout_rows": heldout.rows, "gib": round((train.nbytes + heldout.nbytes) / 2**30, 2)})  # fmt: skip
    t0 = time.time()
    before = greedy_tau(target, tokenizer, draft, args.eval_prompts, args.eval_tokens, tuple(args.eval_sets))
    eval_seconds = time.time() - t0
    log({"event": "greedy_tau", "weights": "start", "seconds": round(eval_seconds, 1), **before})
    budget = started + args.seconds - max(args.reserve, eval_seconds + 10) - time.time()
    budget = max(budget, args.min_train_seconds)  # a rehearsal on a slow CPU still takes some steps
    result = train_for(draft, train, heldout, cfg, budget, draft.draft_vocab, milestones.keep, log)
    draft.load_state_dict({k: v.to(draft.device) for k, v in milestones.best.items()})  # the best, as it ships
    after = greedy_tau(target, tokenizer, draft, args.eval_prompts, args.eval_tokens, tuple(args.eval_sets))
    log({"event": "greedy_tau", "weights": "best", **after})
    better = result.best["tau_proxy"] > result.start["tau_proxy"] and sum(after.values()) > sum(before.values())
    summary = {
        "steps": result.steps, "blocks": result.blocks, "blocks_vs_shipped": round(result.blocks / SHIPPED_BLOCKS, 2),
        "train_seconds": round(result.seconds, 1), "s_per_step": round(result.seconds / max(result.steps, 1), 4),
        "proxy_start": result.start, "proxy_best": result.best, "milestones": result.milestones,
        "greedy_tau_start": before, "greedy_tau_best": after, "better": better,
        "seconds": round(time.time() - started, 1), "train_rows": train.rows, "heldout_rows": heldout.rows,
    }  # fmt: skip
    milestones.update(summary=summary)
    problems = check_outputs(out)
    if problems:
        raise RuntimeError(f"{out} would not come back whole: {'; '.join(problems)}")
    print(json.dumps(summary), flush=True)
    return summary


def unpack(files: Path, run_name: str, state: Path = STATE, init: Path = DRAFT_DIR) -> Path:
    """Check the files a window brought back and lay them out as ``<state>/<run_name>/``, a finished run that
    continues ``init`` (the shipped draft it started from), for ``recipes/smollm2_ship.py``. Returns the run folder."""
    record = json.loads((files / "milestone.json").read_text())
    if record["config_sha256"] != config_hash(init):
        raise ValueError(f"{files} holds weights trained from another draft than {init} (config.json differs)")
    state_dict = {}
    for name, digest in record["files"].items():
        if sha256(files / name) != digest:
            raise ValueError(f"{files / name} is damaged (SHA-256 differs from milestone.json)")
        state_dict.update(load_file(files / name))
    draft = DSparkDraftModel.from_pretrained(init)
    missing, unexpected = draft.load_state_dict(state_dict, strict=False)
    if unexpected or [k for k in missing if not k.startswith("target")]:
        raise ValueError(f"the weights do not fit {init}: missing {missing}, unexpected {unexpected}")
    summary, plan = record.get("summary", {}), record["plan"]
    steps = summary.get("steps", record["best"]["step"])
    run = state / run_name
    run.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(run / "final")
    loss = asdict(LOSSES[plan["loss"]])
    (run / "final" / "train_config.json").write_text(json.dumps({
        "steps": record["best"]["step"], "lr": plan["lr"], "seed": plan["seed"], "anchors": plan["anchors"],
        "batch_size": plan["batch_size"], "loss_weights": loss, "layers_lr_scale": 1.0, "window_steps": steps,
    }, indent=1))  # fmt: skip
    (run / "recipe.json").write_text(json.dumps({
        "head": draft.config.head_type, "init_from": str(init), "continues": shipped_runs(init),
        "rows": len(load_dataset(ANSWERS)), "layers": draft.config.num_draft_layers,
        "head_rank": draft.config.head_rank,
        "hardware": f"{plan['device']}, target in {plan.get('dtype', 'bfloat16')}", "batch_size": plan["batch_size"],
        "command": f"python -m recipes.smollm2_gpu_window run --out $OUT --seconds {plan['seconds']:g} --loss "
        f"{plan['loss']}  (a device call, after the GGUF's parts: docs/training.md)",
    }))  # fmt: skip
    lines = (files / "log.jsonl").read_text().splitlines()
    s_per_step = summary.get("s_per_step") or next((json.loads(x)["s_per_step"] for x in reversed(lines)
                                                   if "s_per_step" in x), None)  # fmt: skip
    (run / "log.jsonl").write_text("\n".join([*lines, json.dumps({"s_per_step": s_per_step, "done": True})]) + "\n")
    (run / "draft_vocab.json").write_text(json.dumps(draft.draft_vocab.tolist()))
    (run / "window_summary.json").write_text(json.dumps(record, indent=1))
    return run


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="train on the device (the last call of the window's training)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seconds", type=float, default=480.0, help="the whole command, loading included")
    p.add_argument("--reserve", type=float, default=40.0, help="kept for the last evaluation and writing")
    p.add_argument("--parts-dir", type=Path, default=PARTS)
    p.add_argument("--gguf", type=Path, default=None, help="the target's GGUF itself, instead of --parts-dir")
    p.add_argument("--init", type=Path, default=DRAFT_DIR, help="the draft to continue (the shipped one)")
    p.add_argument("--loss", default="paper", choices=sorted(LOSSES))
    p.add_argument("--lr", type=float, default=window_training().lr)
    p.add_argument("--batch-size", type=int, default=window_training().batch_size)
    p.add_argument("--anchors", type=int, default=window_training().anchors)
    p.add_argument("--rows", type=int, default=None, help="train on the first N training rows (default: all)")
    p.add_argument("--heldout-rows", type=int, default=None, help="held-out rows for the proxy (default: all)")
    p.add_argument("--heldout-batches", type=int, default=window_training().heldout_batches)
    p.add_argument("--max-length", type=int, default=768)
    p.add_argument("--milestone-seconds", type=float, default=120.0)
    p.add_argument("--log-every", type=int, default=window_training().log_every)
    p.add_argument("--eval-prompts", type=int, default=4, help="prompts of each evaluation set for greedy τ")
    p.add_argument("--eval-tokens", type=int, default=128)
    p.add_argument("--eval-sets", nargs="+", default=list(EVAL_SETS), choices=EVAL_SETS)
    p.add_argument("--min-train-seconds", type=float, default=0.0, help="train at least this long (rehearsals)")
    p.add_argument("--cpu", action="store_true", help="stay on the CPU even where CUDA is available")
    p = sub.add_parser("ship", help="here: unpack what came back, then recipes/smollm2_ship.py on it")
    p.add_argument("files", type=Path)
    p.add_argument("--run", default="run-gpu-window")
    p.add_argument("--state", type=Path, default=STATE)
    p.add_argument("--out", type=Path, default=DRAFT_DIR, help="where the shipped draft goes")
    p.add_argument("--blocks", type=int, default=2000, help="decode blocks STS is refitted on")
    p.add_argument("--calibration-tokens", type=int, default=128)
    p.add_argument("--calibration-prompts", type=int, default=None, help="held-out prompts decoded (default: all)")
    args = ap.parse_args(argv)
    if args.cmd == "run":
        run(args)
        return
    from recipes import smollm2_ship

    run_dir = unpack(args.files, args.run, args.state)
    print(f"unpacked {args.files} -> {run_dir}")
    limit = ["--calibration-prompts", str(args.calibration_prompts)] if args.calibration_prompts else []
    smollm2_ship.main(["--run", args.run, "--state", str(args.state), "--out", str(args.out), "--blocks",
                       str(args.blocks), "--calibration-tokens", str(args.calibration_tokens), *limit])  # fmt: skip


if __name__ == "__main__":
    main()
