"""Where a float32 verify's extra cost lies once the LM head is transposed: the decoder layers' own matmuls.

    python -m benchmarks.verify_body [--threads 2] [--out benchmarks/results/verify_head]

``hf_dspark/decoding/lm_head.py`` computes the verify's LM head as ``W @ hᵀ`` where that pays, because F.linear's
small-M GEMM path cost 2-3x a one-row product there. This asks whether the same re-routing would pay for the decoder
layers' projections: each distinct weight shape of the embedded target's first layer (q/o, k/v, gate/up, down) and
the head, at 1..17 rows, both orientations (``verify_head.matmul_table``: median of 20), and what one layer's
seven projections and the head add up to per step at each row count. Writes ``<out>/verify_body.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.verify_head import matmul_table
from hf_dspark.embedded import fast_dtype, load_target

ROOT = Path(__file__).resolve().parents[1]
PROJECTIONS = {  # name -> (module path in a Llama layer, how many of that shape the layer runs)
    "q/o": ("self_attn.q_proj", 2),
    "k/v": ("self_attn.k_proj", 2),
    "gate/up": ("mlp.gate_proj", 2),
    "down": ("mlp.down_proj", 1),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "verify_head")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = load_target(fast_dtype())
    layer = target.model.layers[0]
    weights = {name: layer.get_submodule(path).weight.detach() for name, (path, _) in PROJECTIONS.items()}
    weights["head"] = target.get_output_embeddings().weight.detach()
    tables = {name: matmul_table(w) for name, w in weights.items()}
    rows = [r["rows"] for r in tables["head"]]
    print("ms, F.linear / transposed")
    print("| weight | shape | " + " | ".join(f"{m} rows" for m in rows) + " |\n|---|---|" + "---|" * len(rows))
    for name, table in tables.items():
        cells = " | ".join(f"{r['linear']:.3f} / {r['transposed']:.3f}" for r in table)
        print(f"| {name} | {tuple(weights[name].shape)} | {cells} |")
    layers = len(target.model.layers)
    per_step = []
    for i, m in enumerate(rows):
        body = {
            o: layers * sum(n * tables[w][i][o] for w, (_, n) in PROJECTIONS.items()) for o in ("linear", "transposed")
        }
        per_step.append({"rows": m, "body_linear_ms": body["linear"], "body_transposed_ms": body["transposed"],
                         "head_transposed_ms": tables["head"][i]["transposed"]})  # fmt: skip
    print(f"\nper step: {layers} layers' projections (F.linear / transposed) and the head (transposed), ms")
    for r in per_step:
        body = f"{r['body_linear_ms']:.1f} / {r['body_transposed_ms']:.1f}"
        print(f"| {r['rows']} | {body} | {r['head_transposed_ms']:.1f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"dtype": str(weights["head"].dtype).removeprefix("torch."), "threads": args.threads,
              "matmul_ms": tables, "per_step_ms": per_step}  # fmt: skip
    (args.out / "verify_body.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out / 'verify_body.json'}")


if __name__ == "__main__":
    main()
