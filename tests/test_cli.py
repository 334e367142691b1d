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
    for name in ("eval", "bench", "export"):
        assert commands[name].get_default("dtype") == "auto", name
    assert commands["export"].get_default("format") == "speculators"
    # the demo's first click must show what we promise (outputs token for token plain greedy's): float32, chosen by
    # benchmarks/demo_precision.py (float32 was the faster of the two on the first example wherever measured)
    assert commands["demo"].get_default("dtype") == "float32"


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


# Every option of every command, with a value the command cannot use, and the message that names it. The walk
# below checks that this table covers every option the parsers declare (flags without a value aside), so an option
# added without a check fails it.
# the flags generated from DecodingConfig (eval and the main command): one bad value each, refused with
# DecodingConfig's own message; a new setting's flag needs its line here
DECODING_BAD_VALUES = {
    "--verify-mode": (["--verify-mode", "fast"], "argument --verify-mode: verify_mode must be one of"),
    "--verify-limit": (["--verify-limit", "257"], "argument --verify-limit: verify_limit must be an int from 0 to 256"),
    "--confidence-threshold": (["--confidence-threshold", "1.5"], "confidence_threshold must lie in [0, 1], got 1.5"),
    "--verify-layout": (["--verify-layout", "ragged"], "argument --verify-layout: verify_layout must be one of"),
    "--confidence-recalibration": (["--confidence-recalibration", "yes"], "must be true or false, got 'yes'"),
    "--cost-recalibration": (["--cost-recalibration", "1"], "argument --cost-recalibration: must be true or false"),
    "--greedy-lookahead": (["--greedy-lookahead", "on"], "argument --greedy-lookahead: must be true or false"),
    "--verify-buckets": (["--verify-buckets", "pow2"], "argument --verify-buckets: must be true or false"),
    "--lookup": (["--lookup", "65"], "argument --lookup-max-ngram/--lookup: lookup_max_ngram must be an int from 0"),
    "--lookup-min-ngram": (["--lookup", "3", "--lookup-min-ngram", "5"], "lookup_min_ngram must be an int between 1"),
    "--lookup-max-tokens": (
        ["--lookup-max-tokens", "0"],
        "lookup_max_tokens must be an int from 1 to 256 (or None: γ), got 0",
    ),
    "--lookup-adaptive": (["--lookup-adaptive", "maybe"], "argument --lookup-adaptive: must be true or false"),
    "--tree-top-k": (["--tree-top-k", "x"], "argument --tree-top-k: must be an integer, got 'x'"),
    "--tree-lookup-merge": (["--tree-lookup-merge", "2"], "argument --tree-lookup-merge: must be true or false"),
}
BAD_VALUES = {
    "prepare": {
        "--target": (["--target", "{tmp}/nope"], "--target {tmp}/nope: no such folder"),
        "--dtype": (["--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
        "--seed": (["--seed", "-1"], "argument --seed: must be 0 or more, got -1"),
        "prompts": (
            ["prepare", "{tmp}/missing.jsonl", "--out", "{tmp}/rows.jsonl"],
            "prompt file {tmp}/missing.jsonl: no such file",
        ),
        "--out": (["--out", "{tmp}"], "argument --out: {tmp} is a folder, not a file"),
        "--limit": (["--limit", "0"], "argument --limit: must be at least 1, got 0"),
        "--max-new-tokens": (["--max-new-tokens", "x"], "argument --max-new-tokens: must be an integer, got 'x'"),
        "--batch-size": (["--batch-size", "0"], "argument --batch-size: must be at least 1, got 0"),
        "--temperature": (["--temperature", "0"], "argument --temperature: must be above 0, got 0.0"),
        "--top-p": (["--top-p", "1.5"], "argument --top-p: must be above 0 and at most 1, got 1.5"),
        "--top-k": (["--top-k", "-1"], "argument --top-k: must be 0 or more, got -1"),
        "--draft": (["--draft", "{tmp}/nope"], "{tmp}/nope: no such folder"),
    },
    "train": {
        "--target": (["--target", "{tmp}/nope"], "--target {tmp}/nope: no such folder"),
        "--dtype": (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        "--seed": (["--seed", "1.5"], "argument --seed: must be an integer, got '1.5'"),
        "--data": (["--data", "{tmp}/missing.jsonl"], "--data {tmp}/missing.jsonl: no such file"),
        "--out": (["--out", "{tmp}/rows.jsonl"], "argument --out: {tmp}/rows.jsonl exists and is not a folder"),
        "--head": (["--head", "lstm"], "argument --head: invalid choice: 'lstm'"),
        "--block-size": (["--block-size", "1"], "argument --block-size: must be from 2 to 256, got 1"),
        "--layers": (["--layers", "0"], "argument --layers: must be at least 1, got 0"),
        "--rank": (["--rank", "0"], "argument --rank: must be at least 1, got 0"),
        "--steps": (["--steps", "0"], "argument --steps: must be at least 1, got 0"),
        "--stop-at": (["--steps", "10", "--stop-at", "20"], "--stop-at 20 is past --steps 10"),
        "--lr": (["--lr", "inf"], "argument --lr: must be a finite number, got 'inf'"),
        "--layers-lr": (["--layers-lr", "-1"], "argument --layers-lr: must be above 0, got -1.0"),
        "--batch-size": (["--batch-size", "0"], "argument --batch-size: must be at least 1, got 0"),
        "--anchors": (["--anchors", "0"], "argument --anchors: must be at least 1, got 0"),
        "--max-length": (["--max-length", "0"], "argument --max-length: must be at least 1, got 0"),
        "--save-every": (["--save-every", "0"], "argument --save-every: must be at least 1, got 0"),
        "--feature-cache": (
            ["--feature-cache", "{tmp}/rows.jsonl"],
            "argument --feature-cache: {tmp}/rows.jsonl exists and is not a folder",
        ),
        "--mixed-precision": (["--mixed-precision", "fp8"], "argument --mixed-precision: invalid choice: 'fp8'"),
        "--loss-weights": (["--loss-weights", "1", "-1", "1"], "argument --loss-weights: must be 0 or more, got -1.0"),
        "--kd-weight": (["--kd-weight", "-0.5"], "argument --kd-weight: must be 0 or more, got -0.5"),
        "--argmax-weight": (["--argmax-weight", "nan"], "argument --argmax-weight: must be a finite number, got 'nan'"),
        "--draft-vocab": (["--draft-vocab", "-1"], "argument --draft-vocab: must be 0 or more, got -1"),
    },
    "calibrate": {
        "--target": (["--target", "{tmp}/nope"], "--target {tmp}/nope: no such folder"),
        "--dtype": (["--dtype", "half"], "argument --dtype: invalid choice: 'half'"),
        "--seed": (["--seed", "-2"], "argument --seed: must be 0 or more, got -2"),
        "--draft": (["--draft", "{tmp}/nope"], "{tmp}/nope: no such folder"),
        "--data": (["--data", "{tmp}/missing.jsonl"], "--data {tmp}/missing.jsonl: no such file"),
        "--prompts": (
            ["calibrate", "--draft", "{draft}", "--source", "decode", "--prompts", "{tmp}/missing.jsonl"],
            "prompt file {tmp}/missing.jsonl: no such file",
        ),
        "--limit": (["--limit", "0"], "argument --limit: must be at least 1, got 0"),
        "--blocks": (["--blocks", "0"], "argument --blocks: must be at least 1, got 0"),
        "--source": (["--source", "sampled"], "argument --source: invalid choice: 'sampled'"),
        "--max-new-tokens": (["--max-new-tokens", "0"], "argument --max-new-tokens: must be at least 1, got 0"),
        "--objective": (["--objective", "mse"], "argument --objective: invalid choice: 'mse'"),
    },
    "eval": {
        "--target": (["--target", "{tmp}/nope"], "--target {tmp}/nope: no such folder"),
        "--dtype": (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
        "--seed": (["--seed", "x"], "argument --seed: must be an integer, got 'x'"),
        "--draft": (["--draft", "{tmp}/nope"], "{tmp}/nope: no such folder"),
        "--datasets": (["--datasets", "gsm8kk"], "unknown dataset 'gsm8kk'"),
        "--limit": (["--limit", "0"], "argument --limit: must be at least 1, got 0"),
        "--max-new-tokens": (["--max-new-tokens", "0"], "argument --max-new-tokens: must be at least 1, got 0"),
        "--temperatures": (["--temperatures", "0", "-1"], "argument --temperatures: must be 0 or more, got -1.0"),
        "--out": (["--out", "{tmp}/rows.jsonl"], "argument --out: {tmp}/rows.jsonl exists and is not a folder"),
        **DECODING_BAD_VALUES,
    },
    "bench": {
        "--target": (["--target", "{tmp}/nope"], "--target {tmp}/nope: no such folder"),
        "--dtype": (["--dtype", "fp32"], "argument --dtype: invalid choice: 'fp32'"),
        "--seed": (["--seed", "-1"], "argument --seed: must be 0 or more, got -1"),
        "--draft": (["--draft", "a={tmp}/nope"], "{tmp}/nope: no such folder"),
        "--datasets": (["--datasets", "{tmp}/missing.jsonl"], "missing.jsonl does not exist"),
        "--limit": (["--limit", "-3"], "argument --limit: must be at least 1, got -3"),
        "--max-new-tokens": (["--max-new-tokens", "0"], "argument --max-new-tokens: must be at least 1, got 0"),
        "--gammas": (["--gammas", "4", "300"], "argument --gammas: must be from 1 to 256, got 300"),
        "--lookup": (["--lookup", "-1"], "argument --lookup: must be from 0 to 64, got -1"),
        "--lookup-min": (["--lookup", "2", "--lookup-min", "3"], "--lookup-min 3 is longer than --lookup 2"),
        "--out": (["--out", "{tmp}/rows.jsonl"], "argument --out: {tmp}/rows.jsonl exists and is not a folder"),
    },
    "export": {
        "--target": (["--target", "{tmp}/nope"], "--target {tmp}/nope: no such folder"),
        "--dtype": (["--dtype", "int4"], "argument --dtype: invalid choice: 'int4'"),
        "--seed": (["--seed", "-1"], "argument --seed: must be 0 or more, got -1"),
        "--draft": (["--draft", "{tmp}/nope"], "{tmp}/nope: no such folder"),
        "--format": (["--format", "gguf"], "argument --format: invalid choice: 'gguf'"),
        "--verifier": (["--verifier", "my model"], "argument --verifier: must be a Hub repository id like org/name"),
        "--out": (["--out", "{tmp}/rows.jsonl"], "argument --out: {tmp}/rows.jsonl exists and is not a folder"),
    },
    "card": {
        "--draft": (["--draft", "{tmp}/nope"], "{tmp}/nope: no such folder"),
        "--name": (["--name", "a/b/c"], "argument --name: must be a Hub repository id like org/name, got 'a/b/c'"),
        "--target-id": (["--target-id", "org/"], "argument --target-id: must be a Hub repository id like org/name"),
        "--license": (["--license", ""], "argument --license: must not be empty"),
    },
    "push": {
        "--draft": (["--draft", "{tmp}/nope"], "--draft {tmp}/nope: no such folder"),
        "--repo": (["--repo", "org name"], "argument --repo: must be a Hub repository id like org/name"),
        "--target-id": (["--target-id", "../x"], "argument --target-id: must be a Hub repository id like org/name"),
        "--license": (["--license", " "], "argument --license: must not be empty"),
        "--message": (["--message", ""], "argument --message: must not be empty"),
    },
    "demo": {
        "--target": (["--target", "{tmp}/nope"], "--target {tmp}/nope: no such folder"),
        "--draft": (["--draft", "{tmp}/nope"], "{tmp}/nope: no such folder"),
        "--dtype": (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
        "--host": (["--host", "my host!"], "argument --host: must be an IP address or a host name, got 'my host!'"),
        "--port": (["--port", "99999"], "argument --port: must be from 1 to 65535, got 99999"),
    },
}
VALID = {  # the arguments each command needs, all valid: a bad value is the only thing wrong
    "prepare": ["{tmp}/prompts.jsonl", "--out", "{tmp}/new.jsonl"],
    "train": ["--data", "{tmp}/rows.jsonl", "--out", "{tmp}/run"],
    "calibrate": ["--draft", "{draft}", "--data", "{tmp}/rows.jsonl"],
    "eval": ["--draft", "{draft}"],
    "bench": ["--draft", "{draft}"],
    "export": ["--draft", "{draft}", "--out", "{tmp}/export"],
    "card": ["--draft", "{draft}"],
    "push": ["--draft", "{draft}", "--repo", "org/name"],
    "demo": [],
}


def _valued_options(parser: argparse.ArgumentParser) -> list[str]:
    """The options of ``parser`` that take a value (positionals by name), not help or on/off flags."""
    return [a.option_strings[-1] if a.option_strings else a.dest for a in parser._actions
            if not isinstance(a, argparse._HelpAction) and a.nargs != 0]  # fmt: skip


def test_the_bad_value_table_covers_every_option_of_every_command():
    commands = subcommands()
    assert set(BAD_VALUES) == set(commands)
    for name, parser in commands.items():
        assert sorted(BAD_VALUES[name]) == sorted(_valued_options(parser)), name


@pytest.mark.parametrize(("command", "option"), [(c, o) for c, table in BAD_VALUES.items() for o in table])
def test_every_option_refuses_a_bad_value_before_anything_loads(no_model_loads, draft_folder, tmp_path, capsys,
                                                                command, option):  # fmt: skip
    """The issue's cases among them: `demo --port 99999` failed after ~70 s of loading, `eval --temperatures -1`
    started evaluating 1,319 prompts."""
    (tmp_path / "rows.jsonl").write_text('{"id": "0", "prompt_ids": [1, 2], "response_ids": [3]}\n')
    (tmp_path / "prompts.jsonl").write_text('{"turns": ["hello"]}\n')
    fill = lambda parts: [p.format(tmp=tmp_path, draft=draft_folder) for p in parts]  # noqa: E731
    bad, message = BAD_VALUES[command][option]
    argv = fill(bad) if bad[0] == command else [command, *fill(VALID[command]), *fill(bad)]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    said = f"{exit_info.value.code if isinstance(exit_info.value.code, str) else ''}\n{capsys.readouterr().err}"
    assert fill([message])[0] in said, said


MAIN_BAD_VALUES = {
    "--prompts": (["--prompts", "{tmp}/missing.jsonl"], "argument --prompts: {tmp}/missing.jsonl: no such file"),
    "--limit": (["--limit", "0"], "argument --limit: must be at least 1, got 0"),
    "--max-new-tokens": (["--max-new-tokens", "-5"], "argument --max-new-tokens: must be at least 1, got -5"),
    "--threads": (["--threads", "0"], "argument --threads: must be at least 1, got 0"),
    "--dtype": (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
    **DECODING_BAD_VALUES,
}


def test_the_main_command_refuses_every_bad_value_before_loading(monkeypatch, tmp_path, capsys):
    from hf_dspark import __main__ as main_command
    from hf_dspark import embedded

    monkeypatch.setattr(embedded, "load", lambda *a, **k: pytest.fail("loaded before the arguments were checked"))
    assert sorted(MAIN_BAD_VALUES) == sorted(_valued_options(main_command.build_parser()))
    for bad, message in MAIN_BAD_VALUES.values():
        with pytest.raises(SystemExit) as exit_info:
            main_command.main([part.format(tmp=tmp_path) for part in bad])
        code = exit_info.value.code  # 2 from argparse; a message for settings that do not fit together
        said = f"{code if isinstance(code, str) else ''}\n{capsys.readouterr().err}"
        assert code == 2 or isinstance(code, str)
        assert message.format(tmp=tmp_path) in said, said


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
    with pytest.raises(SystemExit, match=r"the demo needs Gradio: pip install gradio gradio_client pandas, the"):
        cli.main(["demo", "--draft", str(draft_folder)])
