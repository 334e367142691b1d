"""`hf-dspark {prepare,train,calibrate,eval,bench,export,card,push,demo}`: thin commands over the Python API.

``--target embedded`` means the offline SmolLM2-135M-Instruct; anything else is passed to
``AutoModelForCausalLM.from_pretrained``. Every command checks its arguments (paths, dataset names, ranges) before
it loads a model, and reports an error as one line (``--debug`` shows the traceback instead).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

from .cli_arguments import (
    DTYPES,
    HelpFormatter,
    add_decoding_flags,
    check_datasets,
    check_draft,
    check_files,
    check_target,
    decoding_overrides,
    draft_specs,
    file_path,
    folder_path,
    host,
    int_range,
    load_target,
    lookup_ngram,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
    probability,
    repo_id,
    resolve_dtype,
    text,
)
from .settings import MAX_LOOKUP_NGRAM, MAX_VERIFY_WIDTH


def cmd_prepare(args) -> None:
    from .training.data import mix_prompts, read_prompts, regenerate

    check_files(args.prompts, "prompt file")
    folder = check_draft(args.draft) if args.draft else None
    check_target(args.target)
    sources = {Path(p).stem: read_prompts(p, allow_eval=args.allow_eval) for p in args.prompts}
    counts = {name: args.limit or len(ps) for name, ps in sources.items()}
    prompts = mix_prompts(sources, counts, seed=args.seed)
    target, tokenizer = load_target(args.target, args.dtype)
    draft = None if folder is None else load_draft_for(folder, target)
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
        draft=draft,
    )


def cmd_train(args) -> None:
    from .model.modeling_dspark import DSparkDraftModel
    from .training.data import frequent_tokens, load_dataset
    from .training.losses import LossWeights
    from .training.trainer import TrainConfig, saved_vocab, train

    if args.stop_at is not None and args.stop_at > args.steps:
        raise SystemExit(f"--stop-at {args.stop_at} is past --steps {args.steps}")
    check_files([args.data], "--data")
    check_target(args.target)
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
        layers_lr_scale=args.layers_lr,
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
    check_files(args.prompts, "prompt file")
    check_files([args.data] if args.data else None, "--data")
    check_draft(args.draft)
    check_target(args.target)
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


def load_draft_for(folder: Path, target):
    """The draft in ``folder`` (any layout ``from_pretrained`` reads) in the target's dtype, attached to it; the
    target names the vocabulary, which transformers' native drafters do not record."""
    from .model.modeling_dspark import DSparkDraftModel

    vocab = target.config.get_text_config().vocab_size
    return DSparkDraftModel.from_pretrained(folder, dtype=target.dtype, target_vocab_size=vocab).attach(target)


def _load_drafts(folders: dict[str, Path], target) -> dict:
    """{label: checked folder} (:func:`draft_specs`) -> {label: draft attached to target}."""
    return {label: load_draft_for(folder, target) for label, folder in folders.items()}


def cmd_eval(args) -> None:
    from .evaluation.evaluate import evaluate, markdown_table, plot_acceptance, plot_tau

    folders = draft_specs(args.draft)
    check_datasets(args.datasets)
    check_target(args.target)
    settings = decoding_overrides(args)
    target, tokenizer = load_target(args.target, args.dtype)
    drafts = _load_drafts(folders, target)
    results = [
        evaluate(
            target,
            tokenizer,
            draft,
            name,
            args.limit,
            args.max_new_tokens,
            temperature,
            label,
            settings=settings,
        )
        for label, draft in drafts.items()
        for name in args.datasets
        for temperature in args.temperatures
    ]
    _write_results(Path(args.out), "eval", results, markdown_table(results))
    plot_acceptance(results, Path(args.out) / "acceptance.png")
    plot_tau(results, Path(args.out) / "tau.png")


def cmd_bench(args) -> None:
    from .evaluation.bench import bench, markdown_table, plot_speedups, standard_methods

    if args.lookup and args.lookup_min > args.lookup:
        raise SystemExit(f"--lookup-min {args.lookup_min} is longer than --lookup {args.lookup}")
    folders = draft_specs(args.draft)
    check_datasets(args.datasets)
    check_target(args.target)
    target, tokenizer = load_target(args.target, args.dtype)
    drafts = _load_drafts(folders, target)
    methods = standard_methods(target, drafts, tuple(args.gammas), args.lookup, args.lookup_min)
    results = [bench(target, tokenizer, methods, name, args.limit, args.max_new_tokens) for name in args.datasets]
    _write_results(Path(args.out), "bench", results, markdown_table(results))
    plot_speedups(results, Path(args.out) / "speedup.png")


def cmd_export(args) -> None:
    from .compat import FORMATS, ExportNote
    from .embedded import hub_id

    folder = check_draft(args.draft)
    check_target(args.target)
    dtype = resolve_dtype(args.dtype, draft_folder=folder)  # auto: the draft's own dtype, so nothing is widened
    target, _ = load_target(args.target, dtype, with_tokenizer=False)
    draft = load_draft_for(folder, target)
    fmt = FORMATS[args.format]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fmt.export(draft, args.out, verifier=args.verifier or hub_id(target))
    for w in caught:
        if issubclass(w.category, ExportNote) or "verifier" in str(w.message):  # the export's own, not libraries'
            print(f"{'note' if issubclass(w.category, ExportNote) else 'warning'}: {w.message}", file=sys.stderr)
    print(f"wrote {out} ({fmt.description}, {dtype})")


def cmd_card(args) -> None:
    from .cards import write_card

    check_draft(args.draft)
    print(f"wrote {write_card(args.draft, name=args.name, target=args.target_id, license=args.license)}")


def cmd_push(args) -> None:
    from huggingface_hub import HfApi

    from .cards import write_card
    from .integration.hub_generate import FOLDER, write_custom_generate

    folder = Path(args.draft)
    if not folder.is_dir():
        raise FileNotFoundError(f"--draft {folder}: no such folder (push uploads a local draft folder)")
    check_draft(folder)
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


def cmd_demo(args) -> None:
    try:
        from .demo.app import serve
    except ImportError as e:
        raise SystemExit(
            f"the demo needs Gradio: pip install gradio gradio_client pandas, the package's demo extra ({e})"
        ) from e
    if args.draft is not None:
        check_draft(args.draft)
    check_target(args.target)
    serve(args.target, args.draft, args.dtype, args.host, args.port)


def build_parser() -> argparse.ArgumentParser:
    import transformers

    from . import __version__
    from .compat import FORMATS, exportable
    from .model.heads import HEADS

    ap = argparse.ArgumentParser(
        prog="hf-dspark",
        description="DSpark drafts for Hugging Face transformers: data, training, calibration, evaluation, export, "
        "the Hub and the demo. `hf-dspark COMMAND --help` lists a command's options.",
        formatter_class=HelpFormatter,
    )
    ap.add_argument("--version", action="version",
                    version=f"hf-dspark {__version__} (transformers {transformers.__version__}, torch "
                    f"{torch.__version__})")  # fmt: skip
    ap.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the traceback of an error instead of one line")  # fmt: skip

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, parents=[debug], formatter_class=HelpFormatter)

    def common(p, dtype: str = "auto", dtype_help: str | None = None):
        p.add_argument("--target", default="embedded",
                       help="the target model: 'embedded' (the offline SmolLM2-135M-Instruct GGUF), a Hub id or a "
                       "local folder")  # fmt: skip
        p.add_argument("--dtype", default=dtype, choices=DTYPES,
                       help=dtype_help or "the target's (and draft's) dtype; auto: bfloat16 on CPUs with native bf16 "
                       "units, else float32 (float32 is bit-identical to plain greedy)")  # fmt: skip
        p.add_argument("--seed", type=non_negative_int, default=0, help="random seed")

    train_dtype = "the target's dtype while it answers or feeds features (auto: as for decoding)"
    p = command("prepare", "regenerate answers to prompts with the target (resumable)")
    common(p, "float32", train_dtype)
    p.add_argument("prompts", nargs="+", help="prompt files (JSONL turns/messages/question, or Code Alpaca JSON)")
    p.add_argument("--out", required=True, type=file_path,
                   help="the JSONL file of answered rows to write (appended on resume)")  # fmt: skip
    p.add_argument("--limit", type=positive_int, default=None, help="prompts per file (default: all)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help="longest answer, in tokens")
    p.add_argument("--batch-size", type=positive_int, default=16, help="prompts answered together")
    p.add_argument("--greedy", action="store_true", help="answer greedily instead of sampling")
    p.add_argument("--temperature", type=positive_float, default=0.7, help="sampling temperature")
    p.add_argument("--top-p", type=probability, default=0.8, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--top-k", type=non_negative_int, default=20, help="sample among the k likeliest (0: all)")
    p.add_argument("--allow-eval", action="store_true", help="accept files under eval/ (never for training)")
    p.add_argument("--draft", default=None,
                   help="answer with DSpark decoding through this draft (folder or Hub id): the same answers' "
                   "distribution, faster where the draft pays")  # fmt: skip
    p.set_defaults(func=cmd_prepare)

    p = command("train", "train a draft (accelerate; resumable from --out)")
    common(p, "float32", train_dtype)
    p.add_argument("--data", required=True, help="answered rows (JSONL from `prepare`)")
    p.add_argument("--out", required=True, type=folder_path,
                   help="the run folder: checkpoints, then final/ (an existing run resumes)")  # fmt: skip
    p.add_argument("--head", default="markov", choices=["none", *HEADS],
                   help="sequential head (none: the parallel ablation)")  # fmt: skip
    p.add_argument("--block-size", type=int_range(2, MAX_VERIFY_WIDTH), default=8,
                   help="γ: the block's slots (anchor + masks)")  # fmt: skip
    p.add_argument("--layers", type=positive_int, default=2, help="draft decoder layers")
    p.add_argument("--rank", type=positive_int, default=256, help="the sequential head's rank r")
    p.add_argument("--copy-target-layers", action="store_true", help="start the draft layers from the target's top")
    p.add_argument("--steps", type=positive_int, default=1000, help="optimizer steps in all")
    p.add_argument("--stop-at", type=positive_int, default=None, help="end this run at that step (resume later)")
    p.add_argument("--lr", type=positive_float, default=6e-4, help="peak learning rate")
    p.add_argument("--layers-lr", type=positive_float, default=1.0,
                   help="the draft's decoder layers train at this multiple of --lr (copies of the target's layers "
                   "may want less)")  # fmt: skip
    p.add_argument("--batch-size", type=positive_int, default=1, help="rows per step")
    p.add_argument("--anchors", type=positive_int, default=32, help="blocks drafted per row per step")
    p.add_argument("--max-length", type=positive_int, default=1024, help="rows are cut to this many tokens")
    p.add_argument("--save-every", type=positive_int, default=100, help="steps between checkpoints")
    p.add_argument("--feature-cache", default=None, type=folder_path,
                   help="a folder for the target's features per row: later epochs skip the target's forward and "
                   "its whole-vocabulary softmax (several GB for thousands of rows)")  # fmt: skip
    p.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"], help="accelerate's autocast")
    p.add_argument("--loss-weights", type=non_negative_float, nargs=3, default=[0.1, 0.9, 1.0],
                   metavar=("CE", "TV", "CONF"),
                   help="weights of the CE, total-variation and confidence losses")  # fmt: skip
    p.add_argument("--kd-weight", type=non_negative_float, default=0.0,
                   help="weight of distillation on the target's next-token distribution (-Σ p_t log p_d)")  # fmt: skip
    p.add_argument("--argmax-weight", type=non_negative_float, default=0.0,
                   help="weight of CE on the target's argmax token (the label greedy verification checks)")  # fmt: skip
    p.add_argument("--draft-vocab", type=non_negative_int, default=0,
                   help="train over the N most frequent answer tokens + special tokens and ship with them as the "
                   "draft vocabulary (0: the whole vocabulary; a resumed run keeps its own)")  # fmt: skip
    p.set_defaults(func=cmd_train)

    p = command("calibrate", "STS: fit per-position temperatures, store them in the draft's config")
    common(p, "float32", "the dtype the draft is calibrated in (calibrate in the dtype you decode in)")
    p.add_argument("--draft", required=True, help="a draft folder (config.json + model.safetensors)")
    p.add_argument("--data", help="held-out regenerated rows (JSONL from `prepare`)")
    p.add_argument("--prompts", nargs="+", help="or prompt files, as `prepare` reads them (--source decode only)")
    p.add_argument("--limit", type=positive_int, default=None, help="rows, or prompts per file (default: all)")
    p.add_argument("--blocks", type=positive_int, default=2000, help="blocks to fit the temperatures on")
    p.add_argument(
        "--source", default="teacher-forced", choices=["teacher-forced", "decode"],
        help="teacher-forced blocks inside the held-out answers, or greedy DSpark decoding of their prompts in"
        " --dtype with the draft as deployed (what the scheduler sees at run time)",
    )  # fmt: skip
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="per prompt, with --source decode")
    p.add_argument("--objective", default="ece", choices=["ece", "brier"],
                   help="what each temperature minimises: ECE (the paper's STS) or the Brier score of the prefix"
                   " survival, which a constant prediction cannot game")  # fmt: skip
    p.set_defaults(func=cmd_calibrate)

    from .evaluation.evaluate import DATASETS

    datasets_help = f"names ({' '.join(DATASETS)}) or {{'turns': [...]}} JSONL paths"
    p = command("eval", "τ, per-position acceptance, verify rate and tokens/s on eval prompts")
    common(p)
    p.add_argument("--draft", nargs="+", required=True,
                   help="draft folders or Hub ids, optionally labelled: markov=path none=path")  # fmt: skip
    p.add_argument("--datasets", nargs="+", default=["gsm8k", "humaneval", "mt-bench"], help=datasets_help)
    p.add_argument("--limit", type=positive_int, default=None, help="prompts per dataset (default: all)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens generated per prompt")
    p.add_argument("--temperatures", type=non_negative_float, nargs="+", default=[0.0, 1.0], help="0 means greedy")
    # lookup drafting is off unless asked (the draft alone is measured), whatever the draft's config says
    add_decoding_flags(p, defaults={"lookup_max_ngram": 0}, aliases={"lookup_max_ngram": ["--lookup"]})
    p.add_argument(
        "--out", default="eval-results", type=folder_path, help="folder for eval.json, eval.md and the plots"
    )
    p.set_defaults(func=cmd_eval)

    p = command("bench", "wall-clock vs plain generate and prompt lookup, interleaved, greedy")
    common(p)
    p.add_argument("--draft", nargs="+", required=True,
                   help="draft folders or Hub ids, optionally labelled: markov=path none=path")  # fmt: skip
    p.add_argument("--datasets", nargs="+", default=["gsm8k", "humaneval", "mt-bench"], help=datasets_help)
    p.add_argument("--limit", type=positive_int, default=None, help="prompts per dataset (default: all)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens generated per prompt")
    p.add_argument("--gammas", type=int_range(1, MAX_VERIFY_WIDTH), nargs="*", default=[4, 8, 16],
                   help="fixed verify lengths to bench beside the scheduler (none: skip)")  # fmt: skip
    p.add_argument("--lookup", type=lookup_ngram, default=0, metavar="N",
                   help="also run each draft with lookup drafting, n-grams of N to --lookup-min tokens")  # fmt: skip
    p.add_argument("--lookup-min", type=int_range(1, MAX_LOOKUP_NGRAM), default=2,
                   help="shortest n-gram lookup drafting matches")  # fmt: skip
    p.add_argument(
        "--out", default="bench-results", type=folder_path, help="folder for bench.json, bench.md and the plot"
    )
    p.set_defaults(func=cmd_bench)

    p = command("export", "write a draft in another implementation's layout (speculators for vLLM, DeepSpec)")
    common(p, dtype_help="the dtype written; auto: the draft's own")
    p.add_argument("--draft", required=True, help="a draft folder or Hub id")
    p.add_argument("--format", default="speculators", choices=exportable(),
                   help="; ".join(f"{name}: {FORMATS[name].description}" for name in exportable()))  # fmt: skip
    p.add_argument("--verifier", default=None, type=repo_id,
                   help="speculators: the target's Hub id, recorded for the serving engine (default: the target's "
                   "Hub id; HuggingFaceTB/SmolLM2-135M-Instruct for the embedded one)")  # fmt: skip
    p.add_argument("--out", required=True, type=folder_path, help="the folder to write")
    p.set_defaults(func=cmd_export)

    p = command("card", "write README.md (the model card) into a draft folder")
    p.add_argument("--draft", required=True, help="a draft folder (its eval.json, bench.json, training.json are read)")
    p.add_argument("--name", default=None, type=repo_id,
                   help="the repository name shown in the card (default: the folder's)")  # fmt: skip
    p.add_argument("--target-id", default=None, type=repo_id, help="the target's Hub id, for the usage snippet")
    p.add_argument("--license", default="mit", type=text, help="the card's licence")
    p.set_defaults(func=cmd_card)

    p = command("push", "upload a draft folder (config, safetensors, card) to the Hub")
    p.add_argument("--draft", required=True, help="a draft folder")
    p.add_argument("--repo", required=True, type=repo_id, help="org/name")
    p.add_argument("--target-id", default=None, type=repo_id, help="the target's Hub id, for the card's usage snippet")
    p.add_argument("--license", default="mit", type=text, help="the card's licence")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--card", action="store_true", help="re-render the card even if README.md exists")
    p.add_argument("--message", default="Upload DSpark draft", type=text, help="the commit message")
    p.set_defaults(func=cmd_push)

    p = command("demo", "the Gradio demo: plain generate and DSpark side by side (needs the demo extra)")
    p.add_argument("--target", default="embedded", help="'embedded' (SmolLM2), a Hub id or a local folder")
    p.add_argument("--draft", default=None, help="a draft folder or Hub id (default: the shipped draft)")
    p.add_argument("--dtype", default="float32", choices=DTYPES[:3],
                   help="float32: DSpark's greedy output token for token plain greedy's (chosen by measurement: "
                   "benchmarks/results/demo_precision); bfloat16 (auto: where the CPU has bf16 units) may part at "
                   "near-ties, and the page then offers float32 one click away")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", type=host, help="address to serve on (0.0.0.0: every interface)")
    p.add_argument("--port", type=port, default=7860, help="port to serve on")
    p.set_defaults(func=cmd_demo)
    return ap


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    if isinstance(error, ValueError | FileNotFoundError) and text:
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def main(argv: list[str] | None = None) -> None:
    """Run a command. An error ends it with one line, ``hf-dspark COMMAND: error: ...`` (exit status 1), unless
    ``--debug``, which lets the exception through with its traceback."""
    args = build_parser().parse_args(argv)
    prefix = f"hf-dspark {args.command}: error: "
    try:
        args.func(args)
    except SystemExit as e:  # a command's own refusal: the same one-line form
        if isinstance(e.code, str) and not e.code.startswith(prefix):
            raise SystemExit(prefix + e.code) from None
        raise
    except KeyboardInterrupt:
        raise
    except Exception as e:
        if args.debug:
            raise
        raise SystemExit(f"{prefix}{_one_line(e)} (--debug shows the traceback)") from None


if __name__ == "__main__":
    main()
