"""Publishing: push to a Hub-compatible endpoint on 127.0.0.1 and load back through from_pretrained."""

import json
import os
import subprocess
import sys
from pathlib import Path

from hub_server import start_hub

from hf_dspark import DSparkDraftModel
from hf_dspark.cards import render_card
from hf_dspark.testing import tiny_target


def test_push_and_pull_round_trip(tmp_path):
    server, state, url = start_hub()
    try:
        script = Path(__file__).resolve().parents[1] / "scripts" / "testing" / "hub_roundtrip.py"
        # the environment is kept whole: PYTHONPATH may put an older transformers first (scripts/test.sh)
        env = {
            **os.environ,
            "HF_ENDPOINT": url,
            "HF_TOKEN": "hf_dummy",
            "HF_HUB_OFFLINE": "0",
            "HF_HOME": str(tmp_path / "hf-home"),
            "HF_HUB_DISABLE_XET": "1",
        }
        proc = subprocess.run(
            [sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads((tmp_path / "result.json").read_text())
        assert result == {
            "same_output": True,
            "same_output_2": True,
            "same_weights": True,
            "custom_generate hf-dspark-test/tiny-draft": True,
            "custom_generate hf-dspark-test/tiny-draft-2": True,
            "offline_from_cache_dir": True,
            "empty_cache_refused": True,
            "hub_stop_strings": True,
        }
        files = state.repos["hf-dspark-test/tiny-draft"]
        assert {
            "config.json",
            "model.safetensors",
            "README.md",
            "custom_generate/generate.py",
            "custom_generate/requirements.txt",
        } <= set(files)
        assert b"DRAFT_REPO = 'hf-dspark-test/tiny-draft'" in files["custom_generate/generate.py"]
        assert (
            b"DRAFT_REPO = 'hf-dspark-test/tiny-draft-2'"
            in state.repos["hf-dspark-test/tiny-draft-2"]["custom_generate/generate.py"]
        )
        for name in ("config.json", "model.safetensors"):  # byte-identical to the local folder
            assert files[name] == (tmp_path / "draft" / name).read_bytes()
        assert "hf-dspark-test/tiny-draft" in files["README.md"].decode()
        assert {"config.json", "model.safetensors"} <= set(state.repos["hf-dspark-test/tiny-draft-2"])
    finally:
        server.shutdown()


def test_card_renders_config_and_results(tmp_path):
    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    draft.config.sts_temperatures = [1.5, 1.2, 1.1, 1.0]
    draft.set_draft_vocab([1, 5, 9])
    draft.save_pretrained(tmp_path)
    (tmp_path / "eval.json").write_text(
        json.dumps(
            [
                {
                    "dataset": "gsm8k",
                    "temperature": 0.0,
                    "prompts": 30,
                    "tau": 3.21,
                    "verify_rate": 0.5,
                    "tokens_per_s": 25.0,
                    "position_acceptance": [0.8, 0.7, None, None],
                    "date": "2026-11-29",
                    "machine": "x86_64 2 cores (Linux)",
                    "threads": 2,
                    "device": "cpu",
                    "dtype": "bfloat16",
                }
            ]
        )
    )
    (tmp_path / "training.json").write_text(
        json.dumps(
            {"data": "700 prompts", "steps": 1000, "target weights": "the Q4_1 GGUF of org/target", "runs": [{"lr": 1}]}
        )
    )
    (tmp_path / "calibration.json").write_text(
        json.dumps({"source": "decode", "blocks": 4000, "dtype": "bfloat16", "objective": "brier"})
    )
    card = render_card(tmp_path, name="org/draft", target="org/target")
    assert card.startswith("---\nlibrary_name: hf-dspark\nlicense: mit\nbase_model: org/target\n")
    assert "| block size γ | 4 |" in card and "| sequential head | markov (rank 8) |" in card
    assert (
        "per-position temperatures [1.5, 1.2, 1.1, 1.0] (fitted on 4000 blocks of greedy DSpark decoding in bfloat16, "
        "each minimising the Brier score)"
    ) in card
    assert "| draft vocabulary | 3 tokens (proposals restricted to them;" in card
    assert "| lookup drafting | off (`decoding.lookup_max_ngram = 3` turns it on) |" in card
    draft.decoding.lookup_max_ngram = 4
    draft.save_pretrained(tmp_path)
    assert "| lookup drafting | on: n-grams of 4 down to 2 tokens that occurred earlier" in render_card(tmp_path)
    assert "| gsm8k | 0.0 | 30 | 3.21 | 0.50 | 25.0 | 0.80 0.70 - - |" in card
    assert "Measured 2026-11-29 on x86_64 2 cores (Linux), 2 threads, cpu, bfloat16." in card
    assert "- **data**: 700 prompts" in card and "Not measured yet." in card  # no bench.json
    assert "- **steps**: 1000" in card and "runs" not in card  # the structured history is for tools, not prose
    assert "- Trained and measured against these weights of the target: the Q4_1 GGUF of org/target. Its" in card
    assert "(e.g. the original checkpoint the snippet above loads) is not measured" in card
    assert 'DSparkDraftModel.from_pretrained("org/draft")' in card


def test_shipped_card_is_what_the_template_renders():
    # the ship step writes the card once; a later template change must be re-rendered into the shipped folder
    folder = Path(__file__).resolve().parents[1] / "hf_dspark" / "checkpoints" / "smollm2-135m-instruct-dspark"
    rendered = render_card(
        folder, name="hf-dspark/smollm2-135m-instruct-dspark", target="HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    assert (folder / "README.md").read_text() == rendered
    assert "| confidence head | c_k = σ(wᵀ[h_k; W1[x_{k-1}]]); the prefix scheduler picks" in rendered
