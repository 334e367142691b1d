"""The GPU table's logic on this CPU (the table itself needs CUDA): rows on the same prompts, identity against plain
greedy, τ for DSpark rows, a method that cannot run said so, and work past the deadline skipped, not started."""

import time

import torch

from hf_dspark import DSparkDraftModel, dspark_generate
from hf_dspark.testing import char_tokenizer, tiny_target


def test_table_rows_on_a_tiny_target():
    from benchmarks.gpu_table import Table, markdown

    target = tiny_target("llama", vocab_size=96)
    tokenizer = char_tokenizer()
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in ("abc", "hello there", "x y z", "12 + 3")]
    table = Table(target, tokenizer, prompts, new_tokens=6, reps=1, deadline=time.time() + 600)
    assert [ids.shape for ids, _ in table.batches(2)] == [torch.Size([2, 11]), torch.Size([2, 6])]
    table.run("plain", 2)
    table.run("dspark", 2, verify_mode="fixed", custom_generate=dspark_generate, draft=draft,
              return_dict_in_generate=True)  # fmt: skip
    table.run("broken", 2, num_beams=3, custom_generate=dspark_generate, draft=draft)
    table.deadline = time.time() - 1
    table.run("late", 2)
    plain, ours, broken, late = table.rows
    assert plain["same_as_plain"] == 4 and plain["tau"] is None and plain["tok_s"] > 0
    assert ours["same_as_plain"] == 4 and ours["tau"] >= 1.0 and ours["rows"] == 4
    assert broken["skipped"].startswith("ValueError: DSpark generation does not support beam search")
    assert late == {"method": "late", "batch": 2, "skipped": "out of time"}
    text = markdown({"date": "2026-12-07", "device": "cpu", "new_tokens": 6, "reps": 1, "rows": table.rows})
    plain_line = next(line for line in text.splitlines() if line.startswith("| plain |"))
    assert plain_line.endswith("| 1.00× | - | 4/4 |") and "| dspark | 2 |" in text
    assert "| late | 2 | skipped: out of time |" in text and " 4/4 |" in text


def test_the_native_dflash_rows_run_on_a_llama_target():
    """transformers' own DFlash loop and ours on one untrained drafter of the native layout, shaped for a Llama
    target (SmolLM2's family): both run, and both give plain greedy's tokens."""
    from benchmarks.gpu_table import Table, native_drafter

    target = tiny_target("llama", vocab_size=96, layers=6)
    tokenizer = char_tokenizer()
    drafter, ours = native_drafter(target)
    table = Table(target, tokenizer, [tokenizer.encode("hello there", add_special_tokens=False)] * 4, 8, 1,
                  time.time() + 600)  # fmt: skip
    table.run("plain", 1)
    table.run("native", 1, assistant_model=drafter, speculation_type="dflash")
    table.run("ours", 1, custom_generate=dspark_generate, draft=ours, return_dict_in_generate=True)
    assert [r.get("same_as_plain") for r in table.rows] == [4, 4, 4], table.rows
