"""Data the repository ships and the shard store that regenerated answers live in.

A fresh clone must stand on its own: the evaluation prompts ship in the package, the training prompts in data/train,
and nothing the project runs reads a folder beside the checkout.
"""

import gzip
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from hf_dspark.evaluation.evaluate import DATASETS, eval_dir, load_prompts
from hf_dspark.testing import char_tokenizer, tiny_target
from hf_dspark.training.data import (
    OPEN_SHARD,
    Prompt,
    load_dataset,
    read_answers,
    read_prompts,
    reference_rows,
    regenerate,
    seal_shards,
)

ROOT = Path(__file__).resolve().parents[1]
# a folder beside the checkout, named in pieces so that this file does not name it itself
BESIDE = "shar" + "ed"
OUTSIDE = re.compile(rf"""\.\./{BESIDE}|["']{BESIDE}["']\s*/|{BESIDE}/data""")


def tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / line for line in out.splitlines() if line]


def test_nothing_points_outside_the_repository():
    """Code, tests, scripts and docs name no path beside the checkout (a user's clone has nothing there)."""
    outside = OUTSIDE
    parents = re.compile(r"Path\(__file__\)\.resolve\(\)\.parents\[(\d+)\]")
    offenders = []
    for path in tracked_files():
        if path.suffix not in {".py", ".sh", ".md", ".toml", ".ipynb", ".txt", ".cfg", ".json"} and path.name != "run":
            continue
        text = path.read_text(errors="replace")
        offenders += [f"{path.relative_to(ROOT)}: {m.group(0)!r}" for m in outside.finditer(text)]
        for m in parents.finditer(text):
            up = path.resolve().parents[int(m.group(1))]
            if not up.is_relative_to(ROOT):
                offenders.append(f"{path.relative_to(ROOT)}: {m.group(0)} is {up}, outside the repository")
    assert not offenders, "paths outside the repository:\n" + "\n".join(offenders)


def test_this_checker_catches_a_path_beside_the_checkout(tmp_path):
    """The check above is not vacuous: the same patterns flag the forms that were used before."""
    assert OUTSIDE.search(f'ROOT.parent / "{BESIDE}" / "data" / "eval"')
    assert OUTSIDE.search(f"hf-dspark prepare ../{BESIDE}/data/train/gsm8k_train.jsonl")
    assert not OUTSIDE.search("the verify block's width is shared, and lookups")


def test_dataset_names_resolve_inside_the_package():
    assert eval_dir().is_relative_to(ROOT / "hf_dspark")
    sizes = {name: len(load_prompts(name)) for name in DATASETS}
    assert sizes == {"gsm8k": 1319, "math500": 500, "humaneval": 164, "mbpp": 257, "mt-bench": 80}
    assert load_prompts("mt-bench", limit=1, turn=1)[0]  # two turns each
    with pytest.raises(ValueError, match="unknown dataset 'gsm9k'"):
        load_prompts("gsm9k")


def test_training_prompts_ship_and_make_the_recipe_mix():
    from recipes.smollm2_prepare import ANSWERS, COUNTS, EXTRAS, recipe_prompts

    prompts = recipe_prompts()
    mix, rest = prompts[: sum(COUNTS.values())], prompts[sum(COUNTS.values()) :]
    assert {name: sum(p.source == name for p in mix) for name in COUNTS} == COUNTS
    for stage in EXTRAS:  # each stage in turn, not mixed with the next
        extra, rest = rest[: sum(stage.values())], rest[sum(stage.values()) :]
        assert {name: sum(p.source == name for p in extra) for name in stage} == stage
        assert len(extra) == sum(stage.values())
    assert rest == []
    assert len({p.id for p in prompts}) == len(prompts)
    # The committed answers were regenerated in this order, so it must never change: they are (nearly) a prefix of
    # it, the gaps being prompts over the length limit (~1%) and a batch in progress.
    order = {p.id: i for i, p in enumerate(prompts)}
    answered = [r["id"] for r in load_dataset(ANSWERS)]
    last = max(order[i] for i in answered)
    assert len(answered) > 4000 and last + 1 - len(answered) < 0.03 * len(answered)
    with pytest.raises(ValueError, match="eval/ folder"):
        read_prompts(eval_dir() / "gsm8k.jsonl")


def test_gzipped_prompt_file_reads_like_the_plain_one(tmp_path):
    rows = [{"id": "x7", "turns": ["first"]}, {"turns": ["second"]}]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "src.jsonl").write_text(text)
    (tmp_path / "src.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    plain, packed = read_prompts(tmp_path / "plain" / "src.jsonl"), read_prompts(tmp_path / "src.jsonl.gz")
    assert [(p.id, p.source, p.messages) for p in packed] == [(p.id, p.source, p.messages) for p in plain]
    assert [p.id for p in packed] == ["src:x7", "src:1"]


def _rows(ids):
    return [{"id": str(i), "source": "s", "prompt_ids": [1, 2], "response_ids": [i]} for i in ids]


def test_seal_shards_moves_whole_shards_and_never_rewrites_them(tmp_path):
    (tmp_path / OPEN_SHARD).write_text("".join(json.dumps(r) + "\n" for r in _rows(range(7))))
    written = seal_shards(tmp_path, 3)
    assert [p.name for p in written] == ["answers-00000.jsonl.gz", "answers-00001.jsonl.gz"]
    first = written[0].read_bytes()
    assert [r["id"] for r in load_dataset(written[0])] == ["0", "1", "2"]
    assert [r["id"] for r in load_dataset(tmp_path / OPEN_SHARD)] == ["6"]
    assert [r["id"] for r in load_dataset(tmp_path)] == [str(i) for i in range(7)]
    with (tmp_path / OPEN_SHARD).open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in _rows([7, 8])))
    assert [p.name for p in seal_shards(tmp_path, 3)] == ["answers-00002.jsonl.gz"]
    assert written[0].read_bytes() == first
    assert seal_shards(tmp_path, 3) == []


def test_a_final_seal_keeps_the_short_rest_as_a_last_shard(tmp_path):
    (tmp_path / OPEN_SHARD).write_text("".join(json.dumps(r) + "\n" for r in _rows(range(5))))
    assert [p.name for p in seal_shards(tmp_path, 3)] == ["answers-00000.jsonl.gz"]
    assert [p.name for p in seal_shards(tmp_path, 3, final=True)] == ["answers-00001.jsonl.gz"]
    assert [r["id"] for r in load_dataset(tmp_path / "answers-00001.jsonl.gz")] == ["3", "4"]
    assert load_dataset(tmp_path / OPEN_SHARD) == []
    assert [r["id"] for r in load_dataset(tmp_path)] == [str(i) for i in range(5)]
    assert seal_shards(tmp_path, 3, final=True) == []  # nothing left: no empty shard


def test_shard_folder_after_an_interrupted_seal_reads_each_row_once(tmp_path):
    """Killed between writing a shard and emptying the open file: rows sit in both until the next seal."""
    (tmp_path / OPEN_SHARD).write_text("".join(json.dumps(r) + "\n" for r in _rows(range(4))))
    (tmp_path / "answers-00000.jsonl.gz").write_bytes(
        gzip.compress("".join(json.dumps(r) + "\n" for r in _rows(range(3))).encode())
    )
    assert [r["id"] for r in load_dataset(tmp_path)] == ["0", "1", "2", "3"]
    (tmp_path / OPEN_SHARD).write_text("".join(json.dumps(r) + "\n" for r in _rows(range(6))))
    assert [p.name for p in seal_shards(tmp_path, 3)] == ["answers-00001.jsonl.gz"]
    assert [r["id"] for r in load_dataset(tmp_path)] == [str(i) for i in range(6)]
    assert load_dataset(tmp_path / OPEN_SHARD) == []


def test_a_corrupt_sealed_shard_is_an_error(tmp_path):
    (tmp_path / "answers-00000.jsonl.gz").write_bytes(gzip.compress(b'{"id": "0"}\n{"id": '))
    with pytest.raises(ValueError, match=r"answers-00000.jsonl.gz:2: corrupt line"):
        load_dataset(tmp_path)


def test_regenerate_into_shards_resumes_where_it_stopped(tmp_path):
    from hf_dspark.training.data import Prompt

    target, tokenizer = tiny_target(vocab_size=96), char_tokenizer()
    prompts = [Prompt(f"p:{i}", "p", [{"role": "user", "content": f"question {i}?"}]) for i in range(7)]
    kw = dict(max_new_tokens=4, batch_size=2, shard_rows=3, do_sample=False, progress=False)
    out = tmp_path / "answers"
    regenerate(target, tokenizer, prompts[:4], out, **kw)
    assert sorted(p.name for p in out.iterdir()) == ["answers-00000.jsonl.gz", OPEN_SHARD]
    (out / OPEN_SHARD).write_text((out / OPEN_SHARD).read_text() + '{"id": "p:9", "sou')  # killed mid-line
    regenerate(target, tokenizer, prompts, out, **kw)
    rows = load_dataset(out)
    assert sorted(r["id"] for r in rows) == [p.id for p in prompts]
    assert len(list(out.glob("answers-*.jsonl.gz"))) == 2
    for row in rows:  # greedy answers: what the target itself continues
        ids = torch.tensor([row["prompt_ids"]])
        ref = target.generate(ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1] :].tolist()
        ref = ref[: ref.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in ref else ref
        assert row["response_ids"] == ref
    with pytest.warns(UserWarning, match="nothing to regenerate"):
        regenerate(target, tokenizer, prompts, out, **kw)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_regenerate_with_a_draft_writes_the_same_greedy_answers(tmp_path, batch_size):
    """``draft=``: answers decoded by DSpark (batched, left-padded) are the plain answers, row for row."""
    from hf_dspark import DSparkDraftModel
    from hf_dspark.training.data import Prompt

    target, tokenizer = tiny_target(vocab_size=96), char_tokenizer()
    torch.manual_seed(0)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    prompts = [Prompt(f"p:{i}", "p", [{"role": "user", "content": f"question {'x' * i}?"}]) for i in range(5)]
    kw = dict(max_new_tokens=10, batch_size=batch_size, do_sample=False, progress=False)
    regenerate(target, tokenizer, prompts, tmp_path / "plain.jsonl", **kw)
    regenerate(target, tokenizer, prompts, tmp_path / "dspark.jsonl", draft=draft, **kw)
    plain, dspark = load_dataset(tmp_path / "plain.jsonl"), load_dataset(tmp_path / "dspark.jsonl")
    assert sorted(plain, key=lambda r: r["id"]) == sorted(dspark, key=lambda r: r["id"])
    assert draft.stats.rounds > 0  # the draft did the decoding


def test_function_prompts_keep_the_signature_and_imports_and_drop_the_solution():
    from scripts.make_function_prompts import INSTRUCTION, function_prompt

    solution = (
        "import math\nfrom typing import List\n\n@cache\ndef norms(xs: List[float],\n          p: int = 2) -> float:\n"
        '    """Old docstring."""\n    return math.fsum(x**p for x in xs) ** (1 / p)\n\nprint(norms([3, 4]))\n'
    )
    prompt = function_prompt("Compute the p-norm\nof a list.", "[3, 4]", solution)
    assert prompt == (
        f"{INSTRUCTION}\n```python\nimport math\nfrom typing import List\n\n@cache\ndef norms(xs: List[float],\n"
        '          p: int = 2) -> float:\n    """Compute the p-norm\n    of a list.\n    Example input: [3, 4]\n'
        '    """\n```'
    )
    assert "fsum" not in prompt and "Old docstring" not in prompt
    assert function_prompt("Sum.", "", "def f(a, b):\n    return a + b\n").endswith(
        'def f(a, b):\n    """Sum.\n    """\n```'
    )
    assert function_prompt("x", "", "int main() { return 0; }") is None  # not Python
    assert function_prompt("x", "", "print(sum([1, 2]))\n") is None  # no function
    assert function_prompt("x", "", "def f(a): return a\n") is None  # no body line to leave out


def test_reference_rows_are_the_prompt_then_the_answer_then_eos_not_written_by_the_target():
    tok = char_tokenizer()
    prompts = [Prompt("gsm8k_train:0", "gsm8k_train", [{"role": "user", "content": "1+1?"}]),
               Prompt("gsm8k_train:1", "gsm8k_train", [{"role": "user", "content": "unanswered"}])]  # fmt: skip
    rows = reference_rows(tok, prompts, {"gsm8k_train:0": "It is 2."})
    assert [r["id"] for r in rows] == ["gsm8k_train:0@reference"]  # the prompt without an answer is left out
    (row,) = rows
    assert row["source"] == "gsm8k_train@reference"
    assert row["prompt_ids"] == tok.apply_chat_template(prompts[0].messages, add_generation_prompt=True)["input_ids"]
    assert row["response_ids"] == [*tok("It is 2.", add_special_tokens=False)["input_ids"], tok.eos_token_id]
    assert row["target_wrote"] is False  # the losses take the target's distribution as its labels


def test_reference_answers_are_read_with_errors_that_name_the_line(tmp_path):
    good = tmp_path / "answers.jsonl.gz"
    good.write_bytes(gzip.compress(b'{"id": "a:0", "answer": "x"}\n\n{"id": "a:1", "answer": "y"}\n'))
    assert read_answers(good) == {"a:0": "x", "a:1": "y"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a:0", "answer": "x"}\n{"id": "a:1"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected"):
        read_answers(bad)
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "answers.jsonl").write_text('{"id": "a:0", "answer": "x"}\n')
    with pytest.raises(ValueError, match="eval/ folder"):
        read_answers(tmp_path / "eval" / "answers.jsonl")


def test_vendored_reference_answers_answer_vendored_prompts():
    answers = read_answers(ROOT / "data" / "train" / "reference_answers.jsonl.gz")
    for name in ("gsm8k_train", "codealpaca"):
        ids = {p.id for p in read_prompts(ROOT / "data" / "train" / f"{name}.jsonl.gz")}
        assert ids == {k for k in answers if k.startswith(name + ":")}, name
    assert not any("<<" in a and ">>" in a for k, a in answers.items() if k.startswith("gsm8k_train:"))
    assert answers["gsm8k_train:0"].endswith("\nThe answer is 72.")


def test_gsm8k_solutions_lose_calculator_annotations_and_spell_the_answer():
    from scripts.make_reference_answers import gsm8k_answer

    text = "She sold 48/2 = <<48/2=24>>24 clips.\nIn all 48+24 = <<48+24=72>>72.\n#### 72"
    assert gsm8k_answer(text) == "She sold 48/2 = 24 clips.\nIn all 48+24 = 72.\nThe answer is 72."
    assert gsm8k_answer("no final line") == "no final line"
