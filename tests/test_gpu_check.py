"""The prepared GPU check, dry-run on CPU: the same script, CUDA-only parts reported as skipped with the reason."""

import json

from benchmarks import gpu_check


def test_cpu_dry_run_checks_decoding_and_reports_what_it_skipped(tmp_path, capsys):
    report = gpu_check.main(["--out", str(tmp_path), "--shape", "tiny", "--prompts", "2", "--max-new-tokens", "16"])
    assert report["kernels"] == {"skipped": "no CUDA device: Triton kernels run compiled only on a GPU"}
    f32, bf16 = report["decode_float32"], report["decode_bfloat16"]
    assert f32["ok"] and all(r["identical"] for r in f32["prompts"]) and len(f32["prompts"]) == 2
    assert bf16["ok"] and all(r["identical"] or r["tie"] for r in bf16["prompts"])
    assert all(r["rounds"] > 0 for r in f32["prompts"] + bf16["prompts"])
    assert all(r["tree_identical"] and r["tree_fallback"] is None for r in f32["prompts"])
    costs = report["costs"]
    assert costs["draft_block_ms"] > 0 and set(costs["verify_ms"]) == {1, 9}
    assert set(costs["tree_verify_ms"]) == {1, 9, 17, 33, 65} and costs["tree4_draft_ms"] > 0
    assert costs["peak_memory"] == {"skipped": "no CUDA device: peak memory is read from the CUDA allocator"}
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["decode_float32"]["ok"] is True and saved["shape"] == "tiny"
    summary = (tmp_path / "gpu_check.md").read_text()
    assert "- kernels: skipped (no CUDA device" in summary
    assert "- decode_float32: OK: 2/2 identical to plain (top-4 trees: 2/2)" in summary
    assert summary in capsys.readouterr().out
