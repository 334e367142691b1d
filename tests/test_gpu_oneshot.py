"""The GPU one-shot recipe (recipes/smollm2_gpu_oneshot.py), end to end at toy scale on CPU: the GGUF's parts
fit the call limit and join back bit-exactly (damage is named), and one command regenerates, trains within its
deadline and writes a draft that comes back within the file limits, loads and decodes losslessly."""

import gzip
import json
import sys
import time
from pathlib import Path

import pytest
import torch

from hf_dspark import DSparkDraftModel
from hf_dspark.testing import char_tokenizer, tiny_rows, tiny_target
from hf_dspark.training.data import Prompt, load_dataset, reference_rows

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def oneshot():
    from recipes import smollm2_gpu_oneshot

    yield smollm2_gpu_oneshot


def test_parts_fit_the_room_and_join_back_exactly(oneshot, tmp_path):
    blob = tmp_path / "model.gguf"
    blob.write_bytes(torch.randint(0, 256, (5 * 2**20 + 123,), dtype=torch.uint8).numpy().tobytes())
    wheel = tmp_path / "reader-1.0-py3-none-any.whl"
    wheel.write_bytes(b"w" * 1000)
    room = 2 * 2**20
    manifest = oneshot.pack(blob, tmp_path / "parts", room, [wheel])
    folders = sorted((tmp_path / "parts").iterdir())
    assert len(folders) == len(manifest["parts"]) == 3
    for folder in folders:  # each call's carried folder fits the room beside the tree
        assert sum(f.stat().st_size for f in folder.iterdir()) <= room
    assert (folders[-1] / wheel.name).is_file() and (folders[-1] / "manifest.json").is_file()
    (tmp_path / "joined").mkdir()
    assert oneshot.join(tmp_path / "parts", tmp_path / "joined").read_bytes() == blob.read_bytes()

    chunk = folders[1] / "chunk"
    data = bytearray(chunk.read_bytes())
    data[7] ^= 1
    chunk.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="part-1/chunk is damaged"):
        oneshot.join(tmp_path / "parts", tmp_path / "joined")
    chunk.unlink()
    with pytest.raises(FileNotFoundError, match="part-1/chunk is missing"):
        oneshot.join(tmp_path / "parts", tmp_path / "joined")
    with pytest.raises(ValueError, match="too little room"):
        oneshot.pack(blob, tmp_path / "parts2", 2**20, [wheel])


def test_one_command_regenerates_trains_and_brings_the_draft_back(oneshot, tmp_path, monkeypatch):
    torch.set_num_threads(1)
    target, tokenizer = tiny_target(vocab_size=96, seed=2), char_tokenizer()
    committed = tiny_rows(target, n=10, new_tokens=20)
    prompts = [Prompt(f"q:{i}", "q", [{"role": "user", "content": f"what is {i} + {i}?"}]) for i in range(6)]
    prompts += [Prompt(r["id"], "old", [{"role": "user", "content": "answered"}]) for r in committed[:3]]

    def build(target, tokenizer, rows):
        used = {t for r in rows for t in r["prompt_ids"] + r["response_ids"]}
        mask = next(t for t in range(target.config.vocab_size) if t not in used)
        torch.manual_seed(0)
        return DSparkDraftModel.from_target(target, block_size=4, head_rank=8, qk_norm=True, mask_token_id=mask)

    from hf_dspark.training.trainer import TrainConfig

    small = TrainConfig(lr=3e-3, anchors=4, batch_size=2, max_length=64)
    plan = oneshot.OneShotPlan(seconds=12, regen_seconds=3, regen_batch=4, max_new_tokens=12, probe_steps=3,
                               save_seconds=3, draft_vocab=0, training=small)  # fmt: skip
    out = tmp_path / "OUT"
    started = time.time()
    references = reference_rows(tokenizer, prompts[:2], {p.id: f"it is {i + i}" for i, p in enumerate(prompts[:2])})
    summary = oneshot.oneshot(target, tokenizer, prompts, committed, out, plan, started, build=build,
                              extra_rows=references)  # fmt: skip
    elapsed = time.time() - started
    logged = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    probe = logged[0]  # the schedule was sized from the probe to end by the deadline (the save margin kept)
    assert probe["steps"] == summary["steps"] and probe["steps"] * probe["probe_s_per_step"] <= plan.seconds
    assert elapsed < plan.seconds + 30  # slack for steps slower than the probe's on a loaded machine (CI shares it)
    assert summary["steps"] >= plan.probe_steps and summary["new_answers"] == 6  # committed prompts not redone

    files = sorted(p for p in out.rglob("*") if p.is_file())
    assert len(files) <= oneshot.MAX_FILES and all(p.stat().st_size < oneshot.FILE_LIMIT for p in files)
    with gzip.open(out / "answers-new.jsonl.gz", "rt") as f:
        new = [json.loads(line) for line in f]
    assert sorted(r["id"] for r in new) == [f"q:{i}" for i in range(6)]
    trained = [r for r in [*committed, *new, *references] if not oneshot.is_held_out(r)]
    assert summary["extra_rows"] == 2 and summary["training_rows"] == len(trained)  # the reference rows joined
    assert summary["steps"] - logged[-1]["step"] < summary["steps"] / 50 + 1  # logged to the end

    draft = DSparkDraftModel.from_pretrained(out)
    assert draft.dtype == torch.bfloat16 and draft.config.mask_token_id is not None
    ids = torch.tensor([committed[0]["prompt_ids"]])
    kw = dict(max_new_tokens=12, do_sample=False)
    assert target.generate(ids, assistant_model=draft, **kw).tolist() == target.generate(ids, **kw).tolist()

    # back here: the new answers join the shard folder (rows it already has are skipped), the draft the state dir
    answers, state = tmp_path / "answers", tmp_path / "state"
    monkeypatch.setattr(oneshot, "ANSWERS", answers)
    monkeypatch.setattr(oneshot, "STATE", state)
    answers.mkdir()
    (answers / "open.jsonl").write_text(json.dumps(new[0]) + "\n")
    monkeypatch.setattr(sys, "argv", ["x", "unpack", str(out), "--run", "gpu"])
    oneshot.main()
    assert sorted(r["id"] for r in load_dataset(answers)) == [f"q:{i}" for i in range(6)]
    assert DSparkDraftModel.from_pretrained(state / "gpu" / "final").config.mask_token_id == draft.config.mask_token_id
