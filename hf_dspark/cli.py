"""`hf-dspark {prepare,train,calibrate,eval,bench,export,card,push,results}`: thin commands over the Python API.

``--target embedded`` means the offline SmolLM2-135M-Instruct; anything else is passed to
``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def load_target(spec: str, dtype: str = "float32", with_tokenizer: bool = True):
    """(model, tokenizer or None) for ``spec``: ``embedded`` or a Hub id / local folder."""
    torch_dtype = getattr(torch, dtype)
    if spec == "embedded":
        from .embedded import load_target as load_embedded

        return load_embedded(torch_dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(spec, dtype=torch_dtype).eval().requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(spec, padding_side="left") if with_tokenizer else None


def cmd_prepare(args) -> None:
    from .training.data import mix_prompts, read_prompts, regenerate

    sources = {Path(p).stem: read_prompts(p, allow_eval=args.allow_eval) for p in args.prompts}
    counts = {name: args.limit or len(ps) for name, ps in sources.items()}
    prompts = mix_prompts(sources, counts, seed=args.seed)
    target, tokenizer = load_target(args.target, args.dtype)
    regenerate(
        target,
        tokenizer,
        prompts,
        args.out,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        do_sample=not args.greedy,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
    )


def cmd_train(args) -> None:
    from .modeling_dspark import DSparkDraftModel
    from .training.data import frequent_tokens, load_dataset
    from .training.losses import LossWeights
    from .training.trainer import TrainConfig, saved_vocab, train

    rows = load_dataset(args.data)
    if not rows:
        raise SystemExit(f"no training rows in {args.data}: run `hf-dspark prepare` first")
    try:
        target, tokenizer = load_target(args.target, args.dtype, with_tokenizer=bool(args.draft_vocab))
    except (OSError, ValueError) as e:  # transformers raises either for a folder without tokenizer files
        if not args.draft_vocab:
            raise
        raise SystemExit(f"--draft-vocab needs the target's tokenizer (its special token ids): {e}") from e
    vocab = saved_vocab(args.out)  # a resumed run keeps the vocabulary it started with
    if vocab is None and args.draft_vocab:
        vocab = frequent_tokens(rows, args.draft_vocab, always=tokenizer.all_special_ids)
    torch.manual_seed(args.seed)
    draft = DSparkDraftModel.from_target(
        target,
        block_size=args.block_size,
        num_draft_layers=args.layers,
        head_type=args.head,
        head_rank=args.rank,
        copy_target_layers=args.copy_target_layers,
    )
    cfg = TrainConfig(
        steps=args.steps,
        lr=args.lr,
        batch_size=args.batch_size,
        anchors=args.anchors,
        max_length=args.max_length,
        seed=args.seed,
        save_every=args.save_every,
        mixed_precision=args.mixed_precision,
        loss_weights=LossWeights(*args.loss_weights, kd=args.kd_weight, argmax=args.argmax_weight),
    )
    train(target, draft, rows, args.out, cfg, stop_at=args.stop_at, vocab=vocab, feature_cache=args.feature_cache)


def cmd_calibrate(args) -> None:
    from .training.calibrate import calibrate_draft
    from .training.data import encode_prompt, load_dataset, read_prompts

    if (args.data is None) == (args.prompts is None):
        raise SystemExit("calibrate needs exactly one of --data (prepared rows) and --prompts (prompt files)")
    if args.prompts is not None and args.source != "decode":
        raise SystemExit("--prompts has no answers to teacher-force: use it with --source decode, or pass --data")
    target, tokenizer = load_target(args.target, args.dtype, with_tokenizer=args.prompts is not None)
    if args.prompts is not None:
        prompts = [p for path in args.prompts for p in read_prompts(path)[: args.limit]]
        rows = [{"id": p.id, "prompt_ids": encode_prompt(tokenizer, p)} for p in prompts]
    else:
        rows = load_dataset(args.data)[: args.limit]
    report = calibrate_draft(
        target, args.draft, rows, blocks=args.blocks, seed=args.seed, source=args.source,
        max_new_tokens=args.max_new_tokens, objective=args.objective,
    )  # fmt: skip
    print(json.dumps(report, indent=2))


def _write_results(out: Path, name: str, results: list[dict], table: str) -> None:
    """``<name>.json`` and ``<name>.md`` in ``out``; the table is printed too."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2))
    (out / f"{name}.md").write_text(table)
    print(table)


def _load_drafts(specs: list[str], target) -> dict:
    """``["markov=path", "none=path"]`` (or bare paths, labelled ``dspark``) -> {label: draft attached to target}."""
    from .modeling_dspark import DSparkDraftModel

    drafts = {}
    for spec in specs:
        label, _, path = spec.rpartition("=")
        label = label or "dspark"
        if label in drafts:
            raise SystemExit(f"two drafts are labelled {label!r}: label them, e.g. markov=PATH none=PATH")
        drafts[label] = DSparkDraftModel.from_pretrained(path, dtype=target.dtype).attach(target)
    return drafts


def cmd_eval(args) -> None:
    from .evaluation.evaluate import evaluate, markdown_table, plot_acceptance, plot_tau

    target, tokenizer = load_target(args.target, args.dtype)
    drafts = _load_drafts(args.draft, target)
    for draft in drafts.values():
        if args.verify_mode:
            draft.config.verify_mode = args.verify_mode
    results = [
        evaluate(target, tokenizer, draft, name, args.limit, args.max_new_tokens, temperature, label, args.lookup)
        for label, draft in drafts.items()
        for name in args.datasets
        for temperature in args.temperatures
    ]
    _write_results(Path(args.out), "eval", results, markdown_table(results))
    plot_acceptance(results, Path(args.out) / "acceptance.png")
    plot_tau(results, Path(args.out) / "tau.png")


def cmd_bench(args) -> None:
    from .evaluation.bench import bench, markdown_table, plot_speedups, standard_methods

    target, tokenizer = load_target(args.target, args.dtype)
    drafts = _load_drafts(args.draft, target)
    methods = standard_methods(target, drafts, tuple(args.gammas), args.lookup, args.lookup_min)
    results = [bench(target, tokenizer, methods, name, args.limit, args.max_new_tokens) for name in args.datasets]
    _write_results(Path(args.out), "bench", results, markdown_table(results))
    plot_speedups(results, Path(args.out) / "speedup.png")


def cmd_export(args) -> None:
    from .compat import export_deepspec, export_speculators
    from .modeling_dspark import DSparkDraftModel

    target, _ = load_target(args.target, args.dtype, with_tokenizer=False)
    draft = DSparkDraftModel.from_pretrained(args.draft, dtype=target.dtype).attach(target)
    if args.format == "speculators":
        print(f"wrote {export_speculators(draft, args.out, verifier=args.verifier)} (speculators layout: vLLM)")
    else:
        print(f"wrote {export_deepspec(draft, args.out)} (DeepSpec layout)")


def cmd_card(args) -> None:
    from .cards import write_card

    print(f"wrote {write_card(args.draft, name=args.name, target=args.target_id, license=args.license)}")


def cmd_push(args) -> None:
    from huggingface_hub import HfApi

    from .cards import write_card
    from .hub_generate import FOLDER, write_custom_generate

    folder = Path(args.draft)
    if not (folder / "README.md").is_file() or args.card:
        write_card(folder, name=args.repo, target=args.target_id, license=args.license)
    write_custom_generate(folder, args.repo)  # generate(custom_generate="<repo>", trust_remote_code=True)
    api = HfApi()
    api.create_repo(args.repo, private=args.private, exist_ok=True)
    info = api.upload_folder(
        repo_id=args.repo,
        folder_path=str(folder),
        allow_patterns=["config.json", "model.safetensors", "README.md", "*.json", f"{FOLDER}/*"],
        ignore_patterns=["checkpoint-*", "*.tmp"],
        commit_message=args.message,
    )
    print(f"pushed {folder} to {info.commit_url}")


def cmd_results(args) -> None:
    from .evaluation.readme import write_results

    readme = None if args.readme in (None, "", "none") else args.readme
    write_results(args.out, args.eval, args.bench, plots=args.plots, readme=readme)
    print(f"updated the results in {args.out}" + (f" and the summary in {readme}" if readme else ""))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hf-dspark", description="DSpark drafts: data, training, calibration")
    sub = ap.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--target", default="embedded", help="'embedded' (SmolLM2) or a Hub id / local folder")
        p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
        p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser("prepare", help="regenerate answers to prompts with the target (resumable)")
    common(p)
    p.add_argument("prompts", nargs="+", help="prompt files (JSONL turns/messages/question, or Code Alpaca JSON)")
    p.add_argument("--out", required=True)
    p.add_argument("--limit", type=int, default=None, help="prompts per file")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--allow-eval", action="store_true", help="accept files under eval/ (never for training)")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("train", help="train a draft (accelerate; resumable from --out)")
    common(p)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--head", default="markov", choices=["none", "markov", "gated", "rnn"])
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rank", type=int, default=256)
    p.add_argument("--copy-target-layers", action="store_true")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--stop-at", type=int, default=None, help="end this run at that step (resume later)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--anchors", type=int, default=32)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--feature-cache", default=None,
                   help="a folder for the target's features per row: later epochs skip the target's forward and "
                   "its whole-vocabulary softmax (several GB for thousands of rows)")  # fmt: skip
    p.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
    p.add_argument("--loss-weights", type=float, nargs=3, default=[0.1, 0.9, 1.0], metavar=("CE", "TV", "CONF"))
    p.add_argument("--kd-weight", type=float, default=0.0,
                   help="weight of distillation on the target's next-token distribution (-Σ p_t log p_d)")  # fmt: skip
    p.add_argument("--argmax-weight", type=float, default=0.0,
                   help="weight of CE on the target's argmax token (the label greedy verification checks)")  # fmt: skip
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="train over the N most frequent answer tokens + special tokens and ship with them as the "
                   "draft vocabulary (0: the whole vocabulary; a resumed run keeps its own)")  # fmt: skip
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("calibrate", help="STS: fit per-position temperatures, store them in the draft's config")
    common(p)
    p.add_argument("--draft", required=True, help="a draft folder (config.json + model.safetensors)")
    p.add_argument("--data", help="held-out regenerated rows (JSONL from `prepare`)")
    p.add_argument("--prompts", nargs="+", help="or prompt files, as `prepare` reads them (--source decode only)")
    p.add_argument("--limit", type=int, default=None, help="rows, or prompts per file")
    p.add_argument("--blocks", type=int, default=2000)
    p.add_argument(
        "--source", default="teacher-forced", choices=["teacher-forced", "decode"],
        help="teacher-forced blocks inside the held-out answers, or greedy DSpark decoding of their prompts in"
        " --dtype with the draft as deployed (what the scheduler sees at run time)",
    )  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=128, help="per prompt, with --source decode")
    p.add_argument("--objective", default="ece", choices=["ece", "brier"],
                   help="what each temperature minimises: ECE (the paper's STS) or the Brier score of the prefix"
                   " survival, which a constant prediction cannot game")  # fmt: skip
    p.set_defaults(func=cmd_calibrate)
    p = sub.add_parser("eval", help="τ, per-position acceptance, verify rate and tokens/s on eval prompts")
    common(p)
    p.add_argument("--draft", nargs="+", required=True,
                   help="draft folders or Hub ids, optionally labelled: markov=path none=path")  # fmt: skip
    p.add_argument("--datasets", nargs="+", default=["gsm8k", "humaneval", "mt-bench"],
                   help="names (gsm8k math500 humaneval mbpp mt-bench) or {'turns': [...]} JSONL paths")  # fmt: skip
    p.add_argument("--limit", type=int, default=None, help="prompts per dataset")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="0 means greedy")
    p.add_argument("--verify-mode", default=None, choices=["fixed", "threshold", "scheduled", "async"])
    p.add_argument("--lookup", type=int, default=0, metavar="N",
                   help="decode with lookup drafting, n-grams of N tokens (default 0: the draft alone)")  # fmt: skip
    p.add_argument("--out", default="eval-results")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("bench", help="wall-clock vs plain generate and prompt lookup, interleaved, greedy")
    common(p)
    p.add_argument(
        "--draft", nargs="+", required=True, help="draft folders, optionally labelled: markov=path none=path"
    )
    p.add_argument("--datasets", nargs="+", default=["gsm8k", "humaneval", "mt-bench"])
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gammas", type=int, nargs="*", default=[4, 8, 16], help="fixed verify lengths (none: skip)")
    p.add_argument("--lookup", type=int, default=0, metavar="N",
                   help="also run each draft with lookup drafting, n-grams of N to --lookup-min tokens")  # fmt: skip
    p.add_argument("--lookup-min", type=int, default=2)
    p.add_argument("--out", default="bench-results")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("export", help="write a draft in another implementation's layout (DeepSpec, speculators)")
    common(p)
    p.add_argument("--draft", required=True)
    p.add_argument("--format", default="deepspec", choices=["deepspec", "speculators"])
    p.add_argument(
        "--verifier", default=None, help="speculators: the target's Hub id for vLLM (default: --target's name_or_path)"
    )
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("card", help="write README.md (the model card) into a draft folder")
    p.add_argument("--draft", required=True)
    p.add_argument("--name", default=None, help="the repository name shown in the card")
    p.add_argument("--target-id", default=None, help="the target's Hub id, for the usage snippet")
    p.add_argument("--license", default="mit")
    p.set_defaults(func=cmd_card)

    p = sub.add_parser("push", help="upload a draft folder (config, safetensors, card) to the Hub")
    p.add_argument("--draft", required=True)
    p.add_argument("--repo", required=True, help="org/name")
    p.add_argument("--target-id", default=None)
    p.add_argument("--license", default="mit")
    p.add_argument("--private", action="store_true")
    p.add_argument("--card", action="store_true", help="re-render the card even if README.md exists")
    p.add_argument("--message", default="Upload DSpark draft")
    p.set_defaults(func=cmd_push)

    p = sub.add_parser("results", help="write the results page and the README's summary from eval/bench JSON")
    p.add_argument("--eval", nargs="+", default=None, help="eval.json file(s) from `hf-dspark eval` (concatenated)")
    p.add_argument(
        "--bench",
        nargs="+",
        default=None,
        help="bench.json file(s) from `hf-dspark bench` (several runs are merged; ratios stay per run)",
    )
    p.add_argument("--plots", default=None, help="also write acceptance/tau/speedup PNGs of the merged results here")
    p.add_argument("--out", default="docs/results.md", help="the results page whose results block is rewritten")
    p.add_argument("--readme", default="README.md", help="whose summary block is rewritten ('none': leave it)")
    p.set_defaults(func=cmd_results)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
