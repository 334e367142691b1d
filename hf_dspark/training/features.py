"""Target features cached on disk, so later epochs skip the frozen target's forward pass.

Per training row: the concatenated hidden states the draft reads [L, m·d_t] and the target's final (normed)
hidden state [L, d_t] — O(d) per token instead of O(V) logits; the LM head is applied only where a loss needs
it. One safetensors file per row, written to a temporary name and renamed (a crash never leaves half a file).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def target_outputs(target, layer_ids: list[int], input_ids: torch.Tensor, valid: torch.Tensor):
    """Frozen target forward -> (features [R, L, m·d_t], final hidden [R, L, d_t]) for padded rows."""
    with torch.no_grad():
        out = target(input_ids=input_ids, attention_mask=valid.long(), output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    return feats, out.hidden_states[-1]


class FeatureCache:
    """``get(row)`` returns (features, final hidden) for one row [L, ·], from disk or computed and stored.

    The folder is keyed by the layer ids and storage dtype, so a draft reading other layers never reuses it.
    """

    def __init__(self, root: str | Path, target, layer_ids: list[int], dtype: torch.dtype = torch.float16):
        key = hashlib.sha1(f"{layer_ids}-{dtype}-{target.config.to_json_string()}".encode()).hexdigest()[:12]
        self.dir = Path(root) / key
        self.dir.mkdir(parents=True, exist_ok=True)
        self.target, self.layer_ids, self.dtype = target, list(layer_ids), dtype

    def _path(self, row: dict) -> Path:
        return self.dir / (hashlib.sha1(str(row["id"]).encode()).hexdigest()[:20] + ".safetensors")

    def get(self, row: dict, max_length: int, device: torch.device):
        path = self._path(row)
        ids = (row["prompt_ids"] + row["response_ids"])[:max_length]
        if path.is_file():
            try:
                t = load_file(path)
                if t["features"].shape[0] >= len(ids):
                    return t["features"][: len(ids)].to(device), t["final"][: len(ids)].to(device)
            except Exception:
                pass
        x = torch.tensor([ids], device=device)
        feats, final = target_outputs(self.target, self.layer_ids, x, torch.ones_like(x, dtype=torch.bool))
        tmp = path.with_suffix(".tmp")
        save_file({"features": feats[0].to(self.dtype).cpu(), "final": final[0].to(self.dtype).cpu()}, str(tmp))
        tmp.replace(path)
        return feats[0], final[0]
