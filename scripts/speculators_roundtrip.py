"""A real SmolLM2 draft through the `speculators` format and back (issue #21's check on a trained draft, not a toy).

    PYTHONPATH=.venv/speculators-0.9.0 python -m scripts.speculators_roundtrip DRAFT_DIR \\
        [--out benchmarks/results/speculators_roundtrip.json] [--prompts 4] [--max-new-tokens 64]

1. Export DRAFT_DIR with ``hf-dspark``'s speculators exporter (the SmolLM2 target saved beside it as the verifier).
2. Load the export with speculators' own ``DSparkDraftModel`` and report what its loader found missing,
   unexpected or mis-shaped; compare its block forward (logits over the draft vocabulary, Markov bias,
   confidences) with ours on the target's real hidden states at a few anchors of a real answer.
3. Load the export back into hf-dspark and decode held-out prompts greedily with both drafts (float32 target, every
   block verified in full — the scheduled mode's verify lengths follow a measured, hence noisy, speed profile):
   tokens, verify lengths and accepted tokens per round must be identical.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
from pathlib import Path

import torch
from speculators.models.dspark import DSparkDraftModel as TheirDSpark

from hf_dspark import DSparkDraftModel
from hf_dspark.compat import export_speculators
from hf_dspark.decoding.drafting import target_features
from hf_dspark.embedded import load_target
from recipes.smollm2_ship import held_out_prompts
from scripts.testing.speculators_check import compare, eager, ours_block, theirs_block

ROOT = Path(__file__).resolve().parents[1]


def save_verifier(target, folder: Path) -> None:
    """Save the target as a plain float32 checkpoint (speculators reloads the verifier's embedding and LM head from
    it); a GGUF-loaded model refuses ``save_pretrained``, so its dequantized weights go into a fresh copy."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(target.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(target.state_dict())
    plain.save_pretrained(folder)


def decode(target, draft, prompts, max_new_tokens):
    """Greedy DSpark decoding of each prompt -> [(tokens, proposed, accepted)] per prompt."""
    runs = []
    for ids in prompts:
        out = target.generate(torch.tensor([ids]), assistant_model=draft, max_new_tokens=max_new_tokens,
                              do_sample=False)  # fmt: skip
        runs.append((out[0].tolist(), list(draft.stats.proposed), list(draft.stats.accepted)))
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("draft", type=Path)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "speculators_roundtrip.json")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    target, tokenizer = load_target()
    draft = DSparkDraftModel.from_pretrained(args.draft).float().attach(target).eval()
    prompts = [r["prompt_ids"] for r in held_out_prompts(tokenizer) if len(r["prompt_ids"]) <= 256][: args.prompts]
    result = {"draft": str(args.draft), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        verifier, folder = Path(tmp) / "verifier", Path(tmp) / "export"
        save_verifier(target, verifier)
        export_speculators(draft, folder, verifier=str(verifier))
        result["files"] = sorted(p.name for p in folder.iterdir())
        _, info = TheirDSpark.from_pretrained(str(folder), output_loading_info=True)
        result["loading"] = {k: sorted(map(str, v)) for k, v in info.items() if v}
        theirs = eager(TheirDSpark.from_pretrained(str(folder)).float().eval())
        result["class"] = f"{type(theirs).__module__}.{type(theirs).__name__}"

        ids = torch.tensor([decode(target, draft, prompts[:1], 48)[0][0]])
        with torch.no_grad():
            hidden = target(input_ids=ids, output_hidden_states=True).hidden_states
        features = target_features(draft, hidden)
        gamma = draft.config.block_size
        anchors = [len(prompts[0]) + k for k in (0, 9, 23)]
        anchors = [p for p in anchors if p + gamma <= ids.shape[1]]
        result["forward"] = {
            f"anchor {p}": compare(
                "smollm2", ours_block(draft, features, ids, p), theirs_block(theirs, features, ids, p)
            )
            for p in anchors
        }

        back = DSparkDraftModel.from_pretrained(folder).float().attach(target).eval()
        for d in (draft, back):
            d.decoding.verify_mode = "fixed"
        mine, again = (
            decode(target, draft, prompts, args.max_new_tokens),
            decode(target, back, prompts, args.max_new_tokens),
        )
        result["decode"] = {
            "identical_tokens": all(a[0] == b[0] for a, b in zip(mine, again, strict=True)),
            "identical_rounds": all(a[1:] == b[1:] for a, b in zip(mine, again, strict=True)),
            "rounds": sum(len(r[1]) for r in mine),
            "tau": sum(len(r[0]) - len(p) for r, p in zip(mine, prompts, strict=True)) / sum(len(r[1]) for r in mine),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
