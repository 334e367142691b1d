"""Train the SmolLM2 draft on a borrowed GPU machine in one command: regenerate the missing answers, train, bring
the draft back — inside one ≤ 10-minute call, with no network there.

    python -m recipes.smollm2_gpu_oneshot pack                  # here: split the target's GGUF into call-sized parts
    # there, one device call per part, each carrying .oneshot/part-K; the last call runs:
    python -m recipes.smollm2_gpu_oneshot run --out $OUT [--seconds 540]
    python -m recipes.smollm2_gpu_oneshot unpack FILES_AT [--run NAME]   # here: the draft and the new answers

Why parts: a device call takes the working tree plus what it carries, 64 MiB in all, and the target's Q4_1 GGUF
(98 MB) does not fit beside the tree. ``pack`` splits it into as many parts as the room beside the tree needs
(``.oneshot/`` is ignored by git; the manifest holds every part's SHA-256 and the whole file's) and puts the
``gguf`` reader's wheel (pure Python, imported from the wheel itself) with the last part. A warm machine keeps
what earlier calls brought, so the calls must follow each other within its idle window (30 s).

``run`` joins and checks the parts, loads the target in bfloat16, answers the recipe's prompts that no committed
shard answers yet (the same sampling as ``smollm2_prepare.py``) for at most ``--regen-seconds``, then trains the
recipe's exportable draft on committed + new answers for the rest of the budget: a short probe measures seconds
per step, and the cosine schedule is sized to end before the deadline. Into ``$OUT`` (8 files at most, each
< 16 MiB): the draft in bfloat16 as safetensors shards, its config, the new answers (gzipped JSONL), the training
log and a summary. ``unpack`` appends the new answers to the shard folder (rows already answered here are
skipped; whole shards are sealed as usual) and installs the draft as ``<state>/<run>/final`` for
``smollm2_ship.py``.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from hf_dspark.training.data import OPEN_SHARD, frequent_tokens, load_dataset, regenerate, seal_shards
from hf_dspark.training.losses import LossWeights
from hf_dspark.training.trainer import TrainConfig, train
from recipes.smollm2_prepare import ANSWERS, recipe_prompts
from recipes.smollm2_train import STATE, build_draft, is_held_out, recipe_references, spare_token

ROOT = Path(__file__).resolve().parents[1]

PARTS = ROOT / ".oneshot"
CALL_LIMIT = 64 * 2**20  # what one device call may send: the working tree plus carried paths
FILE_LIMIT = 16 * 2**20  # each file that comes back
MAX_FILES = 8
HEADROOM = 2 * 2**20  # the tree grows between pack and the calls (a new answer shard, a result file)


def gpu_training() -> TrainConfig:
    """The recipe's optimisation on an H200: 32 sequences × 96 anchors per step, bf16 autocast; ``steps`` is sized
    to the deadline by ``train_until``."""
    return TrainConfig(lr=3e-3, anchors=96, batch_size=32, max_length=768,
                       loss_weights=LossWeights(ce=1.0, tv=0.1, conf=1.0), mixed_precision="bf16")  # fmt: skip


@dataclass
class OneShotPlan:
    """What ``run`` spends its budget on. The defaults suit an H200 and SmolLM2-135M; the tests shrink them."""

    seconds: float = 540.0  # the whole command, loading included; the call's limit is 600
    regen_seconds: float = 150.0
    regen_batch: int = 256
    max_new_tokens: int = 256
    probe_steps: int = 10
    save_seconds: float = 45.0  # kept free at the end for saving and writing the outputs
    draft_vocab: int = 8192
    references: bool = False  # also train on the datasets' own answers (issue #48; recipes/smollm2_train.py)
    training: TrainConfig = field(default_factory=gpu_training)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of what a device call sends of the tree: tracked files and untracked ones git does not ignore."""
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root, check=True,
        capture_output=True,
    ).stdout.decode().split("\0")  # fmt: skip
    return sum((root / n).stat().st_size for n in names if n and (root / n).is_file())


def pack(gguf: Path, parts_dir: Path, room: int, extras: list[Path] = ()) -> dict:
    """Split ``gguf`` into ``parts_dir/part-K/`` folders of at most ``room`` bytes each, the ``extras`` (the
    reader's wheel) and ``manifest.json`` going with the last part. Returns the manifest."""
    extra_bytes = sum(p.stat().st_size for p in extras) + 4096
    if room <= extra_bytes + 2**20:
        raise ValueError(f"only {room / 2**20:.1f} MiB beside the working tree: too little room for the parts")
    size = gguf.stat().st_size
    chunk = room - extra_bytes  # every part fits with the extras, so any part may be the last
    if parts_dir.exists():
        shutil.rmtree(parts_dir)
    parts = []
    with gguf.open("rb") as f:
        for k in range(-(-size // chunk)):
            folder = parts_dir / f"part-{k}"
            folder.mkdir(parents=True)
            (folder / "chunk").write_bytes(f.read(chunk))
            parts.append({"folder": folder.name, "bytes": (folder / "chunk").stat().st_size,
                          "sha256": sha256(folder / "chunk")})  # fmt: skip
    last = parts_dir / parts[-1]["folder"]
    for p in extras:
        shutil.copy2(p, last / p.name)
    manifest = {"file": gguf.name, "bytes": size, "sha256": sha256(gguf), "parts": parts}
    (last / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def join(parts_dir: Path, out_dir: Path) -> Path:
    """Reassemble the GGUF from ``parts_dir`` into ``out_dir``, checking every part and the whole; a missing or
    damaged part is named in the error."""
    found = sorted(parts_dir.glob("part-*/manifest.json"))
    if not found:
        raise FileNotFoundError(f"no manifest.json under {parts_dir}/part-*/: carry the last part too")
    manifest = json.loads(found[0].read_text())
    path = out_dir / manifest["file"]
    with path.open("wb") as f:
        for part in manifest["parts"]:
            chunk = parts_dir / part["folder"] / "chunk"
            if not chunk.is_file():
                raise FileNotFoundError(f"{chunk} is missing: every part must be carried by a call of the same lease")
            if sha256(chunk) != part["sha256"]:
                raise ValueError(f"{chunk} is damaged (SHA-256 differs from the manifest): carry it again")
            f.write(chunk.read_bytes())
    if sha256(path) != manifest["sha256"]:
        raise ValueError(f"the joined {manifest['file']} differs from the packed file: pack again")
    return path


def target_gguf(parts_dir: Path, gguf: Path | None = None) -> Path:
    """The target's GGUF: ``gguf`` itself, or the parts in ``parts_dir`` joined and checked into a temporary folder
    (the gguf reader's wheel carried with them goes on the import path, for a machine that has no reader)."""
    for wheel in sorted(parts_dir.glob("part-*/*.whl")):
        sys.path.insert(0, str(wheel))
    return gguf or join(parts_dir, Path(tempfile.mkdtemp()))


def regenerate_for(target, tokenizer, prompts, done: set[str], out: Path, plan: OneShotPlan) -> list[dict]:
    """Answer the ``prompts`` whose ids are not in ``done``, a batch-sized chunk at a time, until
    ``plan.regen_seconds`` have passed; rows go to ``out`` (JSONL), and are returned."""
    todo = [p for p in prompts if p.id not in done]
    start = time.time()
    step = plan.regen_batch  # the clock is read between calls: one batch at a time overruns by one batch at most
    for i in range(0, len(todo), step):
        if time.time() - start > plan.regen_seconds:
            break
        regenerate(target, tokenizer, todo[i : i + step], out, max_new_tokens=plan.max_new_tokens,
                   batch_size=plan.regen_batch, progress=False)  # fmt: skip
    return load_dataset(out) if out.exists() else []


def train_until(target, draft, rows, vocab, run: Path, plan: OneShotPlan, deadline: float, log) -> tuple:
    """Train ``draft`` with a cosine schedule sized to end by ``deadline``: ``plan.probe_steps`` steps in a
    throwaway folder measure seconds per step first. Returns (draft, steps)."""
    cfg = replace(plan.training, steps=10**6, save_every=10**9, log_every=plan.probe_steps)
    probe = []
    initial = {k: v.clone() for k, v in draft.state_dict().items()}
    with tempfile.TemporaryDirectory() as tmp:
        train(target, draft, rows, tmp, cfg, progress=False, log=probe.append, stop_at=plan.probe_steps, vocab=vocab)
    draft.load_state_dict(initial)
    s_per_step = json.loads(probe[-1])["s_per_step"]
    steps = max(plan.probe_steps, int((deadline - time.time()) / s_per_step))
    log(json.dumps({"probe_s_per_step": s_per_step, "steps": steps}))
    cfg = replace(cfg, steps=steps, log_every=max(1, steps // 50), save_every=steps)
    return train(target, draft, rows, run, cfg, progress=False, log=log, vocab=vocab), steps


def recipe_draft(target, tokenizer, rows: list[dict]):
    """The recipe's exportable draft (``smollm2_train.build_draft``, Markov head, its spare mask token)."""
    return build_draft(target, "markov", spare_token(tokenizer, rows))


def oneshot(target, tokenizer, prompts, committed: list[dict], out: Path, plan: OneShotPlan, started: float,
            build=recipe_draft, extra_rows: list[dict] = ()) -> dict:  # fmt: skip
    """Regenerate, train and write the outputs into ``out``; ``started`` is when the command began (time.time()).
    ``build(target, tokenizer, rows)`` makes the untrained draft; ``extra_rows`` (e.g. reference answers) are
    trained on beside the committed and new answers. Returns the summary written to ``out/summary.json``."""
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "train_log.jsonl"

    def log(line: str) -> None:
        print(line, flush=True)
        with log_path.open("a") as f:
            f.write(line + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.time()
        new = regenerate_for(target, tokenizer, prompts, {r["id"] for r in committed}, tmp / "new.jsonl", plan)
        regen_s = time.time() - t0
        with gzip.open(out / "answers-new.jsonl.gz", "wt") as f:
            f.writelines(json.dumps(r) + "\n" for r in new)
        rows = [r for r in [*committed, *new, *extra_rows] if not is_held_out(r)]
        special = tokenizer.all_special_ids
        vocab = frequent_tokens(rows, plan.draft_vocab, always=special) if plan.draft_vocab else None
        draft = build(target, tokenizer, rows)
        deadline = started + plan.seconds - plan.save_seconds
        draft, steps = train_until(target, draft, rows, vocab, tmp / "run", plan, deadline, log)
    draft = draft.to(torch.bfloat16)  # as shipped; a bfloat16 draft attached to a float32 target runs in float32
    draft.save_pretrained(out, max_shard_size=f"{FILE_LIMIT // 2**20 - 1}MB")
    summary = {
        "new_answers": len(new), "regen_seconds": round(regen_s, 1), "training_rows": len(rows),
        "extra_rows": len(extra_rows), "steps": steps,
        "plan": asdict(plan), "seconds": round(time.time() - started, 1), "device": str(target.device),
        "torch": torch.__version__,
    }  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    files = [p for p in out.rglob("*") if p.is_file()]
    too_big = [p.name for p in files if p.stat().st_size >= FILE_LIMIT]
    if len(files) > MAX_FILES or too_big:
        raise RuntimeError(f"{len(files)} output files (at most {MAX_FILES}), too big: {too_big}")
    return summary


def cmd_pack(args) -> None:
    from hf_dspark.embedded import gguf_path

    wheel_dir = Path(tempfile.mkdtemp())
    from importlib.metadata import version

    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"gguf=={version('gguf')}",
                    "-d", str(wheel_dir)], check=True)  # fmt: skip
    room = CALL_LIMIT - tree_bytes() - HEADROOM
    manifest = pack(gguf_path(), args.parts_dir, room, sorted(wheel_dir.glob("*.whl")))
    print(f"{len(manifest['parts'])} parts in {args.parts_dir} ({room / 2**20:.1f} MiB free beside the tree)")
    for k, part in enumerate(manifest["parts"]):
        last = k == len(manifest["parts"]) - 1
        command = "python3 -m recipes.smollm2_gpu_oneshot run --out $OUT" if last else "true"
        print(f"call {k + 1}: carry [{args.parts_dir.relative_to(ROOT) / part['folder']}] command: {command}")


def cmd_run(args) -> None:
    started = time.time()
    plan = replace(OneShotPlan(), seconds=args.seconds, regen_seconds=args.regen_seconds, regen_batch=args.regen_batch,
                   references=args.references)  # fmt: skip
    gguf = target_gguf(args.parts_dir)
    from hf_dspark.embedded import load_target

    device = "cuda" if torch.cuda.is_available() else "cpu"
    target, tokenizer = load_target(torch.bfloat16, gguf)
    target.to(device)
    extra = recipe_references(tokenizer) if plan.references else []
    summary = oneshot(
        target, tokenizer, recipe_prompts(), load_dataset(ANSWERS), args.out, plan, started, extra_rows=extra
    )
    print(json.dumps(summary))


def cmd_unpack(args) -> None:
    from hf_dspark import DSparkDraftModel

    draft = DSparkDraftModel.from_pretrained(args.files)
    final = STATE / args.run / "final"
    final.parent.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(final)
    summary = json.loads((args.files / "summary.json").read_text())
    (final / "train_config.json").write_text(json.dumps({"steps": summary["steps"], "oneshot": summary}))
    done = {r["id"] for r in load_dataset(ANSWERS)}
    with gzip.open(args.files / "answers-new.jsonl.gz", "rt") as f:
        new = [json.loads(line) for line in f if json.loads(line)["id"] not in done]
    with (ANSWERS / OPEN_SHARD).open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in new)
    sealed = seal_shards(ANSWERS, 250)
    print(f"draft -> {final}; {len(new)} new answers appended, {len(sealed)} shards sealed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--parts-dir", type=Path, default=PARTS)
    p = sub.add_parser("run")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--parts-dir", type=Path, default=PARTS)
    p.add_argument("--seconds", type=float, default=OneShotPlan.seconds)
    p.add_argument("--regen-seconds", type=float, default=OneShotPlan.regen_seconds)
    p.add_argument("--regen-batch", type=int, default=OneShotPlan.regen_batch)
    p.add_argument("--references", action="store_true", help="also train on the datasets' own answers (#48)")
    p = sub.add_parser("unpack")
    p.add_argument("files", type=Path)
    p.add_argument("--run", default="run-oneshot-gpu")
    args = ap.parse_args()
    {"pack": cmd_pack, "run": cmd_run, "unpack": cmd_unpack}[args.cmd](args)


if __name__ == "__main__":
    main()
