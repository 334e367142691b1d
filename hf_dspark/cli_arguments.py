"""The command line's arguments: what ``--target`` and ``--dtype`` resolve to, and each option's type and pre-load
check. A type refuses what a command cannot use, so argparse reports it as a usage error (exit 2) before anything
loads (``tests/test_cli.py`` feeds every option of every command a bad value). The decoding-settings flags are
generated from ``DecodingConfig``."""

from __future__ import annotations

import argparse
import difflib
import ipaddress
import math
import re
import typing
from pathlib import Path

import torch

from .settings import MAX_LOOKUP_NGRAM, DecodingConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_dtype(name: str, draft_folder: str | Path | None = None) -> str:
    """``--dtype`` as a torch dtype name. ``auto``: the dtype ``draft_folder``'s checkpoint is stored in when one is
    given (an export keeps it), else bfloat16 on CPUs with native bf16 units and float32 elsewhere (as the main
    command and the demo choose)."""
    if name != "auto":
        return name
    if draft_folder is not None:
        from .model.checkpoint_files import read_config

        raw = read_config(Path(draft_folder))
        stored = raw.get("dtype") or raw.get("torch_dtype")
        if stored in DTYPES[1:]:
            return stored
    from .embedded import fast_dtype

    return str(fast_dtype()).replace("torch.", "")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _checked(parse, ok, rule: str):
    """An argparse type: ``parse(text)``, refused unless ``ok(value)``, with the message "must be <rule>"."""

    def check(text: str):
        value = parse(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {value}")
        return value

    return check


positive_int = _checked(_int, lambda v: v >= 1, "at least 1")
non_negative_int = _checked(_int, lambda v: v >= 0, "0 or more")
positive_float = _checked(_float, lambda v: v > 0, "above 0")
non_negative_float = _checked(_float, lambda v: v >= 0, "0 or more")
probability = _checked(_float, lambda v: 0 < v <= 1, "above 0 and at most 1")


def int_range(low: int, high: int):
    """An argparse type: an integer from ``low`` to ``high``."""
    return _checked(_int, lambda v: low <= v <= high, f"from {low} to {high}")


def text(value: str) -> str:
    if not value.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return value


def repo_id(value: str) -> str:
    """A Hub repository id, ``org/name`` (or ``name``), as the Hub spells them."""
    if not re.fullmatch(r"(?:[\w.-]+/)?[\w.-]+", value) or ".." in value or value.startswith(("-", ".")):
        raise argparse.ArgumentTypeError(f"must be a Hub repository id like org/name, got {value!r}")
    return value


def host(value: str) -> str:
    """An address to serve on: an IP address or a host name."""
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    labels = value.rstrip(".").split(".")
    if not value or len(value) > 253 or not all(re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?", x)
                                                  for x in labels):  # fmt: skip
        raise argparse.ArgumentTypeError(f"must be an IP address or a host name, got {value!r}")
    return value


port = int_range(1, 65535)
lookup_ngram = int_range(0, MAX_LOOKUP_NGRAM)


def _setting_kinds(name: str) -> set:
    """The types a ``DecodingConfig`` field takes: {int, NoneType} for ``int | None``."""
    hint = typing.get_type_hints(DecodingConfig)[name]
    return set(typing.get_args(hint)) or {hint}


def setting_value(name: str):
    """An argparse type for the ``DecodingConfig`` field ``name``: the text read as the field's type (``true`` or
    ``false`` for a switch, ``none`` where the field may be ``None``), then checked as ``DecodingConfig`` checks it,
    with its message."""
    kinds = _setting_kinds(name)

    def parse(text: str):
        word = text.strip().lower()
        if word == "none" and type(None) in kinds:
            value = None
        elif bool in kinds:
            if word not in ("true", "false"):
                raise argparse.ArgumentTypeError(f"must be true or false, got {text!r}")
            value = word == "true"
        elif int in kinds:
            value = _int(text)
        elif float in kinds:
            value = _float(text)
        else:
            value = text
        try:
            DecodingConfig(**{name: value})
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return value

    return parse


def add_decoding_flags(parser: argparse.ArgumentParser, defaults: dict | None = None, aliases: dict | None = None):
    """One flag per ``DecodingConfig`` field (``verify_mode`` -> ``--verify-mode``), generated from the dataclass (its
    type, its check, its docstring entry as the help) so that a new setting is a flag without touching this file;
    each defaults to ``None`` (the draft's own setting) unless ``defaults`` names another, and ``aliases`` adds
    older spellings ({field: ["--lookup"]})."""
    group = parser.add_argument_group("decoding settings (default: the draft's own, from its decoding_config.json)")
    for name in DecodingConfig.field_names():
        flags = ["--" + name.replace("_", "-"), *(aliases or {}).get(name, [])]
        metavar = "true|false" if bool in _setting_kinds(name) else name.rsplit("_", 1)[-1].upper()
        default = (defaults or {}).get(name)
        help = DecodingConfig.describe(name).replace("``", "").replace("%", "%%")
        help += f" (default: {default})" if default is not None else ""
        group.add_argument(*flags, dest=name, type=setting_value(name), default=default, metavar=metavar, help=help)


def decoding_overrides(args: argparse.Namespace) -> dict:
    """The decoding settings a command line gave (the flags :func:`add_decoding_flags` made), ``None`` left out;
    ``SystemExit`` naming the problem when they do not fit together (checked over the defaults, before any load)."""
    given = {name: getattr(args, name) for name in DecodingConfig.field_names() if getattr(args, name) is not None}
    try:
        DecodingConfig().replace(**given)
    except ValueError as err:
        raise SystemExit(f"decoding settings: {err}") from None
    return given


def folder_path(value: str) -> str:
    """A folder to write into: it may exist, as a folder."""
    if Path(value).expanduser().exists() and not Path(value).expanduser().is_dir():
        raise argparse.ArgumentTypeError(f"{value} exists and is not a folder")
    return value


def file_path(value: str) -> str:
    """A file to write (or append to): it may exist, as a file."""
    if Path(value).expanduser().is_dir():
        raise argparse.ArgumentTypeError(f"{value} is a folder, not a file")
    return value


def check_target(spec: str) -> None:
    """The target exists before anything loads: the embedded GGUF is installed, a local folder has a config.json;
    a Hub id is left to transformers."""
    from .model.checkpoint_files import looks_like_path, read_config

    if spec == "embedded":
        from .embedded import gguf_path

        gguf_path()
        return
    folder = Path(spec).expanduser()
    if folder.is_dir():
        read_config(folder)
    elif folder.exists() or looks_like_path(spec):
        raise FileNotFoundError(f"--target {spec}: no such folder (use 'embedded', a model folder or a Hub id)")


def check_draft(spec: str | Path) -> Path:
    """A draft argument (a folder or Hub id) checked to hold a readable checkpoint; returns its local folder."""
    from .model.checkpoint_files import check_weight_files, checkpoint_folder, read_config

    folder = checkpoint_folder(spec)
    read_config(folder)
    check_weight_files(folder)
    return folder


def check_files(paths: list[str] | None, what: str) -> None:
    for path in paths or []:
        if not Path(path).is_file():
            raise FileNotFoundError(f"{what} {path}: no such file")


def check_datasets(names: list[str]) -> None:
    """Each name is a known dataset or a prompt file that reads (a misspelled name is named, with the closest)."""
    from .evaluation.evaluate import DATASETS, load_prompts

    for name in names:
        if not Path(name).suffix and name not in DATASETS:
            close = difflib.get_close_matches(name, DATASETS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown dataset {name!r}{hint}: use one of {', '.join(DATASETS)} or a .jsonl path")
        load_prompts(name, limit=1)


def draft_specs(specs: list[str]) -> dict[str, Path]:
    """``["markov=path", "none=path"]`` (or bare paths, labelled ``dspark``) -> {label: checked local folder}."""
    folders = {}
    for spec in specs:
        label, _, path = spec.rpartition("=")
        label = label or "dspark"
        if label in folders:
            raise SystemExit(f"two drafts are labelled {label!r}: label them, e.g. markov=PATH none=PATH")
        folders[label] = check_draft(path)
    return folders


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def load_target(spec: str, dtype: str = "float32", with_tokenizer: bool = True):
    """(model, tokenizer or None) for ``spec``: ``embedded`` or a Hub id / local folder; ``dtype`` a torch dtype
    name or ``auto`` (:func:`resolve_dtype`)."""
    torch_dtype = getattr(torch, resolve_dtype(dtype))
    if spec == "embedded":
        from .embedded import load_target as load_embedded

        return load_embedded(torch_dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(spec, dtype=torch_dtype).eval().requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(spec, padding_side="left") if with_tokenizer else None
