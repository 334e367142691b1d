"""The GPU window's training recipe (recipes/smollm2_gpu_window.py), rehearsed on this CPU: the real ``run`` command
on the real GGUF (packed into parts and joined, as the device calls carry it) and the real shipped draft, a budget
of seconds, then ``ship`` (unpack + the ship step) into a temporary folder. ``pytest -k rehears`` runs the
rehearsal alone."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_dspark import DSparkDraftModel
from hf_dspark.testing import tiny_target

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def window():
    from recipes import smollm2_gpu_window

    return smollm2_gpu_window


@pytest.fixture(scope="module")
def rehearsed(tmp_path_factory):
    """What the device's ``run`` leaves in $OUT, run as the window runs it (a subprocess from the repository root),
    on the CPU with a budget of seconds; (out folder, seconds it took)."""
    from hf_dspark.embedded import gguf_path
    from recipes.smollm2_gpu_oneshot import pack

    base = tmp_path_factory.mktemp("window")
    pack(gguf_path(), base / "parts", 60 * 2**20)  # two parts, as two calls carry them
    out = base / "out"
    command = [sys.executable, "-m", "recipes.smollm2_gpu_window", "run", "--out", str(out), "--parts-dir",
               str(base / "parts"), "--cpu", "--seconds", "20", "--reserve", "2", "--min-train-seconds", "3",
               "--rows", "4", "--heldout-rows", "2", "--max-length", "192", "--batch-size", "1", "--anchors", "8",
               "--heldout-batches", "1", "--milestone-seconds", "1", "--log-every", "1", "--eval-prompts", "1",
               "--eval-tokens", "8", "--eval-sets", "mt-bench"]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_rehearsal_run_brings_back_a_whole_draft_within_the_file_limits(rehearsed):
    files = sorted(p.name for p in rehearsed.iterdir())
    assert len(files) <= 8 and all((rehearsed / f).stat().st_size < 16 * 2**20 for f in files)
    assert "milestone.json" in files and "log.jsonl" in files
    record = json.loads((rehearsed / "milestone.json").read_text())
    summary = record["summary"]
    assert summary["steps"] > 0 and summary["blocks"] == summary["steps"] * 1 * 8
    assert set(summary["greedy_tau_start"]) == {"mt-bench"} and summary["proxy_start"]["tau_proxy"] >= 1.0
    assert isinstance(summary["better"], bool) and record["plan"]["device"] == "cpu"
    assert sorted(record["files"]) == [f for f in files if f.startswith(f"weights-{record['slot']}-")]
    events = [json.loads(line) for line in (rehearsed / "log.jsonl").read_text().splitlines()]
    assert [e.get("event") for e in events[:3]] == ["features", "greedy_tau", "start"]
    assert any("s_per_step" in e for e in events) and events[-1]["event"] == "greedy_tau"


def test_rehearsal_ships_what_came_back(rehearsed, window, tmp_path, smollm2):
    """``ship`` unpacks the files into a run that continues the shipped draft's history, and the ship step turns it
    into a shipped folder that loads and decodes losslessly."""
    from hf_dspark.embedded import DRAFT_DIR

    shipped = tmp_path / "shipped"
    window.main(["ship", str(rehearsed), "--run", "rehearsal", "--state", str(tmp_path / "state"), "--out",
                 str(shipped), "--blocks", "2", "--calibration-tokens", "24",
                 "--calibration-prompts", "1"])  # fmt: skip
    run = tmp_path / "state" / "rehearsal"
    recipe = json.loads((run / "recipe.json").read_text())
    assert recipe["init_from"] == str(DRAFT_DIR) and recipe["command"].startswith(
        "python -m recipes.smollm2_gpu_window"
    )
    names = sorted(p.name for p in shipped.iterdir())
    assert {"config.json", "model.safetensors", "training.json", "calibration.json", "README.md"} <= set(names)
    assert sum(p.stat().st_size for p in shipped.iterdir()) < 40 * 2**20
    training = json.loads((shipped / "training.json").read_text())
    assert training["runs"][-1]["run"] == "rehearsal" and "smollm2_gpu_window run" in training["command"]
    history = json.loads((DRAFT_DIR / "training.json").read_text())["runs"]
    unmarked = lambda runs: [{k: v for k, v in r.items() if k != "shipped"} for r in runs]  # noqa: E731
    assert unmarked(training["runs"][:-1]) == unmarked(history)  # the shipped draft's history, continued
    record = json.loads((rehearsed / "milestone.json").read_text())
    weights = {}
    for name in record["files"]:
        from safetensors.torch import load_file

        weights.update(load_file(rehearsed / name))
    draft = DSparkDraftModel.from_pretrained(shipped)
    for key, value in draft.state_dict().items():
        assert torch.equal(value, weights[key]), key  # the best weights, as they came back
    before = json.loads((DRAFT_DIR / "config.json").read_text())
    after = json.loads((shipped / "config.json").read_text())
    assert all(after[k] == v for k, v in before.items() if k != "sts_temperatures")  # the same draft, refitted
    target, tokenizer = smollm2  # float32
    draft.attach(target)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Count to five."}], add_generation_prompt=True,
                                        return_tensors="pt")["input_ids"]  # fmt: skip
    plain = target.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=draft), plain)


def test_unpack_refuses_damaged_or_foreign_weights(rehearsed, window, tmp_path):
    import shutil

    files = tmp_path / "files"
    shutil.copytree(rehearsed, files)
    record = json.loads((files / "milestone.json").read_text())
    first = sorted(record["files"])[0]
    data = bytearray((files / first).read_bytes())
    data[-1] ^= 1
    (files / first).write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{first} is damaged"):
        window.unpack(files, "bad", tmp_path / "state")
    other = tmp_path / "other"
    DSparkDraftModel.from_target(tiny_target("llama"), block_size=4, head_rank=8).save_pretrained(other)
    with pytest.raises(ValueError, match="trained from another draft"):
        window.unpack(rehearsed, "bad", tmp_path / "state", init=other)


def test_milestones_alternate_slots_so_a_whole_draft_is_always_named(window, tmp_path):
    target = tiny_target("llama")
    init = tmp_path / "init"
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    draft.save_pretrained(init)
    keeper = window.Milestones(tmp_path / "out", init, {"loss": "paper"})
    for step in range(3):
        with torch.no_grad():
            next(draft.parameters()).add_(1.0)
        keeper.keep(draft, {"step": step, "tau_proxy": 1.0 + step})
        record = json.loads((tmp_path / "out" / "milestone.json").read_text())
        assert record["slot"] == "ab"[step % 2] and record["best"]["step"] == step
        names = sorted(p.name for p in (tmp_path / "out").iterdir())
        assert all(n in names for n in record["files"]) and len(names) <= 8
    assert [list(g) for g in window.shard({"a": torch.zeros(4), "b": torch.zeros(4), "c": torch.zeros(2)}, 24)] == [
        ["a"], ["b", "c"]]  # fmt: skip
    with pytest.raises(ValueError, match="alone is"):
        window.shard({"a": torch.zeros(8)}, limit=16)
