"""The speculators layout (what vLLM serves), checked against the installed speculators 0.9.0 package itself.

speculators pins transformers <= 5.19, so it is not installed into the project's environment: scripts/setup.sh puts
it in .venv/speculators-0.9.0 with the modules importing its model classes needs, and the comparison runs in a
subprocess with that folder on its path (scripts/testing/speculators_check.py).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_dspark import DSparkDraftModel
from hf_dspark.compat import export_speculators
from hf_dspark.testing import tiny_target

ROOT = Path(__file__).resolve().parents[1]
SPECULATORS = Path(os.environ.get("HF_DSPARK_SPECULATORS", ROOT / ".venv" / "speculators-0.9.0"))


def test_export_and_import_match_speculators_own_classes(tmp_path):
    """Our export loads into speculators' DSpark/DFlash classes with no missing, unexpected or mis-shaped tensor,
    and a checkpoint speculators itself writes loads into hf-dspark; in both directions the two compute the same
    block logits, Markov bias and confidences on the same target hidden states (Llama-style target with a gated
    head and a draft vocabulary, Qwen3 with an RNN head, a Markov head whose confidence skips its feature, DFlash)."""
    assert (SPECULATORS / "speculators-0.9.0.dist-info").is_dir(), f"run scripts/setup.sh: no {SPECULATORS}"
    env = {**os.environ, "PYTHONPATH": str(SPECULATORS), "HF_HUB_OFFLINE": "1"}
    script = ROOT / "scripts" / "testing" / "speculators_check.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    cases = ["llama-gated-vocab", "qwen3-rnn", "qwen3-markov-no-head-feature", "dflash"]
    assert sorted(result) == sorted(f"{c}: {way}" for c in cases for way in ("ours -> theirs", "theirs -> ours"))
    for name, entry in result.items():
        if "ours -> theirs" in name:
            assert entry["loading"] == {}, (name, entry["loading"])  # nothing missing, unexpected or mis-shaped
            assert entry["class"] == ("DFlashDraftModel" if name.startswith("dflash") else "DSparkDraftModel")
        present = {part for part, diff in entry["diff"].items() if diff is not None}
        assert present == ({"logits"} if name.startswith("dflash") else {"logits", "bias", "confidence"}), name
        assert all(diff < 1e-5 for diff in entry["diff"].values() if diff is not None), (name, entry["diff"])


@pytest.mark.parametrize("head", ["gated", "rnn"])
def test_exported_draft_decodes_identically_after_loading_back(tmp_path, head):
    """Export → from_pretrained gives the same greedy tokens and the same per-round acceptance, with the draft
    vocabulary, the STS temperatures and the verify settings carried over."""
    target = tiny_target("llama", dtype=torch.float64)
    draft = DSparkDraftModel.from_target(
        target, block_size=4, head_rank=8, head_type=head, qk_norm=True, mask_token_id=7
    ).double()
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.3)
    draft.set_draft_vocab(list(range(3, 96, 2)))
    draft.config.sts_temperatures = [1.0, 1.5, 2.0, 2.5]
    draft.decoding.verify_mode = "scheduled"
    draft.decoding.lookup_max_ngram, draft.decoding.lookup_max_tokens, draft.decoding.lookup_adaptive = 3, 6, True
    draft.decoding.confidence_recalibration = False  # not the default: the export must carry it
    export_speculators(draft, tmp_path / "spec", verifier="org/target")
    raw = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert (
        raw["speculators_model_type"] == "dspark"
        and raw["speculators_config"]["verifier"]["name_or_path"] == "org/target"
    )
    assert raw["transformer_layer_config"]["model_type"] == "llama" and raw["draft_vocab_size"] == 47
    back = DSparkDraftModel.from_pretrained(tmp_path / "spec")
    assert back.config.sts_temperatures == [1.0, 1.5, 2.0, 2.5] and back.decoding.verify_mode == "scheduled"
    lookup = back.decoding
    assert (lookup.lookup_max_ngram, lookup.lookup_max_tokens, lookup.lookup_adaptive) == (3, 6, True)
    assert back.decoding.confidence_recalibration is False
    assert torch.equal(back.draft_vocab, draft.draft_vocab) and back.dtype == torch.float64
    draft.decoding.verify_mode = back.decoding.verify_mode = "fixed"  # a plan that needs no timing: runs comparable
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    runs = []
    for d in (draft, back):
        out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=d)
        runs.append((out.tolist(), d.stats.proposed, d.stats.accepted, d.stats.confidences))
    assert runs[0] == runs[1]  # tokens, verify lengths, acceptance and confidences, round by round
    assert runs[0][0] == target.generate(ids, max_new_tokens=30, do_sample=False).tolist()
    assert sum(runs[0][2]) > 0  # the draft's proposals were accepted, so its weights mattered


def test_a_draft_storing_draft_vocabulary_rows_exports_the_same_checkpoint(tmp_path):
    """A head that keeps W2's rows for the draft vocabulary only (head_vocab='draft', as the shipped draft does)
    exports tensor for tensor what the same draft with the whole-vocabulary W2 exports."""
    from safetensors.torch import load_file

    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8, qk_norm=True, mask_token_id=7)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.3)
    draft.set_draft_vocab(list(range(3, 96, 2)))
    export_speculators(draft, tmp_path / "full", verifier="org/target")
    export_speculators(draft.set_head_vocab("draft"), tmp_path / "compact", verifier="org/target")
    full, compact = (load_file(tmp_path / name / "model.safetensors") for name in ("full", "compact"))
    assert full.keys() == compact.keys() and full["markov_head.markov_w2.weight"].shape == (47, 8)
    assert all(torch.equal(full[k], compact[k]) for k in full)


def test_import_keeps_draft_vocabulary_rows_in_any_d2t_order(tmp_path):
    """speculators stores W2 (and d2t) for the draft vocabulary in whatever order d2t lists it; the import keeps
    those rows only (head_vocab 'draft'), sorted by token id like ours: a permuted checkpoint loads the same draft."""
    from safetensors.torch import load_file, save_file

    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8, qk_norm=True, mask_token_id=7)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.3)
    draft.set_draft_vocab(list(range(3, 96, 2))).attach(target)
    folder = export_speculators(draft, tmp_path / "spec", verifier="org/target")
    weights = load_file(folder / "model.safetensors")
    ids = weights["d2t"] + torch.arange(47)
    perm = torch.randperm(47, generator=torch.Generator().manual_seed(0))
    weights["d2t"] = ids[perm] - torch.arange(47)
    for key in ("markov_head.markov_w2.weight", "lm_head.weight"):
        weights[key] = weights[key][perm].contiguous()
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    back = DSparkDraftModel.from_pretrained(folder)
    assert back.config.head_vocab == "draft" and torch.equal(back.draft_vocab, draft.draft_vocab)
    compact = draft.set_head_vocab("draft").state_dict()
    assert all(torch.equal(back.state_dict()[k], v) for k, v in compact.items())


def test_what_the_layout_cannot_hold_is_refused_with_the_remedy():
    """A Llama-style draft with a learned mask vector (the layout SmolLM2 drafts shipped in before 2026-12)
    cannot be expressed: the error names both remedies; a draft narrower than its target is refused too."""
    old_layout = DSparkDraftModel.from_target(tiny_target("llama"), block_size=4, head_rank=8)
    with pytest.raises(ValueError, match=r"qk_norm=True.*mask_token_id=<a spare token id>"):
        export_speculators(old_layout, "/nonexistent/never-written")
    target = tiny_target("qwen3")
    narrow = DSparkDraftModel.from_target(target, block_size=4, hidden_size=16, qk_norm=True, mask_token_id=7)
    with pytest.raises(ValueError, match=r"as wide as its target \(16 vs 32\)"):
        export_speculators(narrow, "/nonexistent/never-written")


def test_cli_exports_the_speculators_layout(tmp_path):
    from hf_dspark.cli import main

    target = tiny_target("qwen3")
    target.save_pretrained(tmp_path / "target")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8, qk_norm=True, mask_token_id=7)
    draft.save_pretrained(tmp_path / "draft")
    main(
        [
            "export",
            "--format",
            "speculators",
            "--draft",
            str(tmp_path / "draft"),
            "--target",
            str(tmp_path / "target"),
            "--out",
            str(tmp_path / "out"),
        ]
    )
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert raw["speculators_config"]["verifier"]["name_or_path"] == str(tmp_path / "target")
    assert raw["aux_hidden_state_layer_ids"] == draft.config.target_layer_ids and raw["mask_token_id"] == 7
    back = DSparkDraftModel.from_pretrained(tmp_path / "out")
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), draft.state_dict().values(), strict=True))


def test_the_recipe_trains_drafts_that_export(smollm2, tmp_path):
    """recipes/smollm2_train.py builds the SmolLM2 draft in the exportable layout by default (q/k norms, mask slots
    embedding the spare <empty_output> token): it exports, and loads back decoding identically."""
    from recipes.smollm2_train import build_draft, spare_token

    target, tokenizer = smollm2
    rows = [{"id": "a", "prompt_ids": [1, 9, 30], "response_ids": [40, 50, 2]}]
    token = spare_token(tokenizer, rows)
    assert tokenizer.convert_ids_to_tokens(token) == "<empty_output>"
    with pytest.raises(ValueError, match="occurs in training rows \\['b'\\]"):
        spare_token(tokenizer, [*rows, {"id": "b", "prompt_ids": [token], "response_ids": []}])
    draft = build_draft(target, "markov", token)
    assert draft.config.qk_norm and draft.config.mask_token_id == token
    export_speculators(draft, tmp_path / "spec", verifier="HuggingFaceTB/SmolLM2-135M-Instruct")
    raw = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert raw["transformer_layer_config"]["model_type"] == "llama" and raw["mask_token_id"] == token
    back = DSparkDraftModel.from_pretrained(tmp_path / "spec")
    ids = tokenizer("def fib(n):", return_tensors="pt")["input_ids"]
    outs = []
    for d in (draft, back):
        d.decoding.verify_mode = "fixed"
        out = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=d)
        outs.append((out.tolist(), d.stats.proposed, d.stats.accepted))
    assert outs[0] == outs[1]


def test_the_shipped_draft_exports_and_decodes_identically_after_loading_back(smollm2, tmp_path):
    """The SmolLM2 draft the package ships is in the exportable layout: through the speculators format and back,
    its weights are unchanged where they can matter and it decodes the same tokens with the same acceptance."""
    from hf_dspark.embedded import DRAFT_DIR

    target, tokenizer = smollm2
    shipped = DSparkDraftModel.from_pretrained(DRAFT_DIR).attach(target)  # the export stores the reduced LM head
    export_speculators(shipped, tmp_path / "spec", verifier="HuggingFaceTB/SmolLM2-135M-Instruct")
    back = DSparkDraftModel.from_pretrained(tmp_path / "spec")
    assert back.config.draft_vocab_size == shipped.config.draft_vocab_size == 8194
    # the format keeps the Markov output rows of the draft vocabulary only, as the shipped draft does: the import
    # stores them the same way (head_vocab "draft"), so every tensor comes back as it was
    assert back.config.head_vocab == shipped.config.head_vocab == "draft"
    ours, theirs = shipped.state_dict(), back.state_dict()
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], v) for k, v in ours.items())
    ids = tokenizer("Write a Python function that reverses a string.", return_tensors="pt")["input_ids"]
    outs = []
    for d in (shipped, back):
        d.decoding.verify_mode, d.decoding.lookup_max_ngram = "fixed", 0  # the draft alone, every block verified
        out = target.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=d)
        outs.append((out.tolist(), d.stats.proposed, d.stats.accepted))
    assert outs[0] == outs[1] and sum(outs[0][2]) > 0
    assert outs[0][0] == target.generate(ids, max_new_tokens=16, do_sample=False).tolist()


def test_a_malformed_speculators_checkpoint_is_refused_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    target = tiny_target("qwen3")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8, qk_norm=True, mask_token_id=7)
    folder = export_speculators(draft, tmp_path / "spec")
    weights = load_file(folder / "model.safetensors")
    del weights["markov_head.markov_w1.weight"]
    weights["fc.weight"] = weights["fc.weight"][:, :-1].contiguous()
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['sequential_head.markov_w1.weight'\].*fc.weight"):
        DSparkDraftModel.from_pretrained(folder)
