"""`hf-dspark` as a user meets it: a version, help with defaults for every option, arguments checked before any
model loads, and one plain line per error (``--debug`` for the traceback)."""

import argparse
import subprocess
import sys

import pytest
import torch

import hf_dspark
from hf_dspark import DSparkDraftModel, cli
from hf_dspark.testing import tiny_target


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    import transformers

    assert capsys.readouterr().out == (
        f"hf-dspark {hf_dspark.__version__} (transformers {transformers.__version__}, torch {torch.__version__})\n"
    )


def test_every_option_has_help_and_shows_its_default():
    commands = subcommands()
    assert sorted(commands) == ["bench", "calibrate", "card", "demo", "eval", "export", "prepare", "push", "train"]
    for name, parser in commands.items():
        text = parser.format_help().split("\noptions:\n", 1)[1]  # the option list, not the usage line
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
            shows_default = action.default not in (None, False, argparse.SUPPRESS) and action.option_strings
            if shows_default:
                flag = action.option_strings[-1]
                block = text.split(f"  {flag}", 1)[1].split("\n  -", 1)[0]
                assert "(default:" in " ".join(block.split()), f"{name} {flag} does not show its default"


def test_decoding_commands_default_to_the_dtype_the_main_command_uses():
    commands = subcommands()
    for name in ("eval", "bench", "export", "demo"):
        assert commands[name].get_default("dtype") == "auto", name
    assert commands["export"].get_default("format") == "speculators"


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load fails the test: the arguments must be refused before."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(cli, "load_target", refuse)
    monkeypatch.setattr(DSparkDraftModel, "from_pretrained", refuse)


@pytest.fixture(scope="module")
def draft_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli") / "draft"
    DSparkDraftModel.from_target(tiny_target("llama"), block_size=4, head_rank=8).save_pretrained(folder)
    return folder


def test_a_misspelled_dataset_is_refused_before_loading(no_model_loads, draft_folder):
    with pytest.raises(
        SystemExit, match=r"^hf-dspark eval: error: unknown dataset 'gsm8kk' \(did you mean 'gsm8k'\?\)"
    ):
        cli.main(["eval", "--draft", str(draft_folder), "--datasets", "gsm8kk"])
    with pytest.raises(SystemExit, match=r"^hf-dspark bench: error: .*missing\.jsonl does not exist"):
        cli.main(["bench", "--draft", str(draft_folder), "--datasets", "missing.jsonl"])


def test_a_bad_draft_path_is_refused_before_loading(no_model_loads, tmp_path):
    (tmp_path / "rows.jsonl").write_text("{}\n")
    extras = {"export": ["--out", str(tmp_path / "out")], "calibrate": ["--data", str(tmp_path / "rows.jsonl")]}
    for command in ("eval", "bench", "export", "calibrate", "card"):
        extra = extras.get(command, [])
        with pytest.raises(SystemExit, match=f"^hf-dspark {command}: error: {tmp_path / 'nope'}: no such folder"):
            cli.main([command, "--draft", str(tmp_path / "nope"), *extra])


def test_a_bad_target_or_data_path_is_refused_before_loading(no_model_loads, draft_folder, tmp_path):
    with pytest.raises(SystemExit, match=f"^hf-dspark eval: error: --target {tmp_path / 'x'}: no such folder"):
        cli.main(["eval", "--draft", str(draft_folder), "--target", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match=f"^hf-dspark train: error: --data {tmp_path / 'rows.jsonl'}: no such file"):
        cli.main(["train", "--data", str(tmp_path / "rows.jsonl"), "--out", str(tmp_path / "run")])
    with pytest.raises(SystemExit, match=f"^hf-dspark prepare: error: prompt file {tmp_path / 'p.jsonl'}: no such"):
        cli.main(["prepare", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "rows.jsonl")])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["eval", "--draft", "d", "--max-new-tokens", "0"], "argument --max-new-tokens: must be at least 1, got 0"),
        (["bench", "--draft", "d", "--limit", "-3"], "argument --limit: must be at least 1, got -3"),
        (["train", "--data", "d", "--out", "o", "--lr", "0"], "argument --lr: must be above 0, got 0.0"),
        (["eval", "--draft", "d", "--lookup", "-1"], "argument --lookup: must be 0 or more, got -1"),
        (["export", "--draft", "d", "--out", "o", "--format", "gguf"], "argument --format: invalid choice: 'gguf'"),
    ],
)
def test_out_of_range_arguments_are_usage_errors(no_model_loads, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_debug_lets_the_traceback_through(no_model_loads, tmp_path):
    for argv in (["--debug", "eval"], ["eval", "--debug"]):
        with pytest.raises(FileNotFoundError, match="no such folder"):
            cli.main([*argv, "--draft", str(tmp_path / "nope")])


def test_an_error_is_one_line_on_stderr(tmp_path):
    """As a user runs it: the console script, a bad path, one line on stderr and exit status 1."""
    run = subprocess.run(
        [sys.executable, "-m", "hf_dspark.cli", "bench", "--draft", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1
    assert run.stdout == ""
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    expected = f"{tmp_path / 'nope'}: no such folder (a draft checkpoint is a folder or a Hub repo id)"
    assert lines == [f"hf-dspark bench: error: {expected} (--debug shows the traceback)"]


def test_demo_without_gradio_says_which_extra(monkeypatch, draft_folder):
    import builtins

    real_import = builtins.__import__

    def no_gradio(name, *args, **kwargs):
        if name == "gradio" or name.startswith("gradio."):
            raise ImportError("No module named 'gradio'")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "hf_dspark.demo.app", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_gradio)
    with pytest.raises(SystemExit, match=r"the demo needs Gradio: pip install 'hf-dspark\[demo\]'"):
        cli.main(["demo", "--draft", str(draft_folder)])
