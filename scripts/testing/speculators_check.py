"""Run by tests/test_speculators.py with the real ``speculators`` package on PYTHONPATH: our export loads into
speculators' own DSpark/DFlash classes, a checkpoint speculators writes loads into hf-dspark, and both compute the
same block (draft logits, Markov bias, confidences) on the same target hidden states.

    python scripts/testing/speculators_check.py WORK_DIR   -> WORK_DIR/result.json

Cases: a Llama-style target (SmolLM2's architecture) with a gated Markov head and a draft vocabulary; a Qwen3
target with an RNN head and a full vocabulary; a DFlash draft (no head, anchor slot proposes nothing).
Their forward is their training forward (``_backbone_forward``: anchored blocks over a packed sequence) with one
anchor, so it reads the same context as our decoding: every position before the anchor.
"""

import json
import sys
from pathlib import Path

import torch
from speculators.models.attention import create_float_mask
from speculators.models.dflash import DFlashDraftModel as TheirDFlash
from speculators.models.dspark import DSparkDraftModel as TheirDSpark

from hf_dspark import DSparkDraftModel
from hf_dspark.compat import export_speculators
from hf_dspark.testing import tiny_target

CASES = {
    "llama-gated-vocab": dict(arch="llama", head_type="gated", vocab=True, offset=0),
    "qwen3-rnn": dict(arch="qwen3", head_type="rnn", vocab=False, offset=0),
    "qwen3-markov-no-head-feature": dict(arch="qwen3", head_type="markov", vocab=True, offset=0, with_head=False),
    "dflash": dict(arch="qwen3", head_type="none", vocab=False, offset=1, confidence=False),
}


def eager(model):
    """Their default attention is compiled flex attention; eager computes the same on a CPU."""
    model.config.transformer_layer_config._attn_implementation = "eager"
    model._attn_impl, model._create_mask_fn = "eager", create_float_mask
    return model


@torch.no_grad()
def theirs_block(model, features, ids, p):
    """Their block at anchor p: (draft-vocab logits [γ, Vd], Markov bias [γ, Vd] or None, confidence logits or None)."""
    T = ids.shape[1]
    loss_mask = torch.zeros(1, T, dtype=torch.long)
    loss_mask[0, p] = 1  # one valid anchor position, so their random anchor choice has one outcome
    d = model.config.transformer_layer_config.hidden_size
    hidden, logits, _, _, idx = model._backbone_forward(
        features, ids, loss_mask, torch.zeros(1, T, d), torch.zeros(1, T, dtype=torch.long), max_anchors=1
    )
    assert idx.tolist() == list(range(p, p + model.block_size))
    block = ids[0, idx].view(1, -1)
    hidden = hidden.view(1, model.block_size, -1)
    bias = conf = None
    prev = block if model.config.sample_from_anchor else torch.cat([block[:, :1], block[:, :-1]], dim=1)
    if getattr(model, "markov_head", None) is not None:
        emb = model.markov_head.prev_embeddings(prev)
        bias = model.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden, prev_emb=emb)[0]
    if getattr(model, "confidence_head", None) is not None:
        feats = hidden
        if model.config.confidence_head_with_markov:
            feats = torch.cat([hidden, model.markov_head.prev_embeddings(prev)], dim=-1)
        conf = model.confidence_head(feats)[0]
    return logits[0], bias, conf


@torch.no_grad()
def ours_block(draft, features, ids, p):
    """Our decoding forward at anchor p over the same columns: (logits [γ, Vd], bias [γ, Vd] or None, conf)."""
    gamma = draft.config.block_size
    kv = draft.context_key_values(features[:, :p], torch.arange(p)[None])
    out = draft(draft.embed_block(ids[:, p]), torch.arange(p, p + gamma)[None], kv)
    cols = draft.draft_vocab if draft.draft_vocab is not None else torch.arange(out.logits.shape[-1])
    block = ids[0, p : p + gamma]
    prev = block if draft.config.draft_offset == 0 else torch.cat([block[:1], block[:-1]])
    biases, confs, state = [], [], None
    for k in range(gamma):
        h = out.hidden_states[:, k]
        feature = None
        if draft.sequential_head is not None:
            bias, feature, state = draft.sequential_head.step(prev[k : k + 1], h, state)
            biases.append(bias[0] if draft.config.head_vocab == "draft" else bias[0, cols])  # "draft": these rows
        if draft.confidence is not None:
            confs.append(draft.confidence.logit(h, feature)[0])
    logits = out.logits[0][:, cols]
    return logits, torch.stack(biases) if biases else None, torch.stack(confs) if confs else None


def compare(name, a, b):
    """Largest absolute difference of each part (block logits, bias, confidences); None where both lack it."""
    diffs = {}
    for part, x, y in zip(("logits", "bias", "confidence"), a, b, strict=True):
        if (x is None) != (y is None):
            raise AssertionError(f"{name}: {part} present on one side only")
        diffs[part] = None if x is None else float((x.float() - y.float()).abs().max())
    return diffs


def build(case, work):
    torch.manual_seed(0)
    target = tiny_target(case["arch"], vocab_size=96, layers=4)
    verifier = work / f"verifier-{case['arch']}"
    target.save_pretrained(verifier)  # speculators reloads the verifier's embedding and LM head from it
    draft = DSparkDraftModel.from_target(
        target, block_size=4, head_rank=8, head_type=case["head_type"], qk_norm=True, mask_token_id=7,
        draft_offset=case["offset"], confidence_head=case.get("confidence", True),
        confidence_with_head=case.get("with_head", True) and case["head_type"] != "none",
    )  # fmt: skip
    with torch.no_grad():  # a random draft whose every part matters (W2 and the heads start at zero)
        for p in draft.parameters():
            p.normal_(0, 0.3)
    if case["vocab"]:
        draft.set_draft_vocab(sorted(torch.randperm(96, generator=torch.Generator().manual_seed(1))[:40].tolist()))
    return target, verifier, draft


def main(work: Path) -> None:
    result = {}
    g = torch.Generator().manual_seed(2)
    for name, case in CASES.items():
        target, verifier, draft = build(case, work)
        m = len(draft.config.target_layer_ids)
        features = torch.randn(1, 14, m * 32, generator=g)
        ids = torch.randint(3, 96, (1, 14), generator=g)
        p = 6
        # ours -> theirs
        folder = export_speculators(draft, work / f"{name}-ours", verifier=str(verifier))
        their_class = (
            TheirDSpark
            if json.loads((folder / "config.json").read_text())["speculators_model_type"] == "dspark"
            else TheirDFlash
        )
        # their loader reports missing/unexpected tensors only when asked, and then skips reloading the verifier's
        # embedding: ask once for the report, load again to compute
        _, info = their_class.from_pretrained(str(folder), output_loading_info=True)
        theirs = eager(their_class.from_pretrained(str(folder)).eval())
        loading = {k: sorted(v) if isinstance(v, list | set) else str(v) for k, v in info.items() if v}
        result[f"{name}: ours -> theirs"] = {
            "class": type(theirs).__name__,
            "loading": loading,
            "diff": compare(name, ours_block(draft, features, ids, p), theirs_block(theirs, features, ids, p)),
        }
        # theirs -> ours: a checkpoint speculators wrote (its config, its random weights)
        with torch.no_grad():
            for key, value in theirs.state_dict().items():
                if value.is_floating_point() and not key.startswith(("embed_tokens", "verifier_", "lm_head")):
                    value.normal_(0, 0.3)
        theirs.save_pretrained(work / f"{name}-theirs")
        back = DSparkDraftModel.from_pretrained(work / f"{name}-theirs").attach(target).eval()
        result[f"{name}: theirs -> ours"] = {
            "diff": compare(name, ours_block(back, features, ids, p), theirs_block(theirs, features, ids, p)),
        }
    (work / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
