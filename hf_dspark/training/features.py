"""Target features cached on disk, so later epochs skip the frozen target's forward pass.

Per training row: the concatenated hidden states the draft reads [L, m·d_t], the target's final (normed) hidden
state [L, d_t] — O(d) per token instead of O(V) logits — and two numbers per position that summarise the target's
whole-vocabulary distribution: its log-normaliser and its argmax. With those, a step that trains over a draft
vocabulary applies the LM head to the draft vocabulary's rows only (6× fewer columns for SmolLM2's 8k of 49k)
instead of recomputing the whole-vocabulary softmax at every slot of every step. One safetensors file per row,
written to a temporary name and renamed (a crash never leaves half a file).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..decoding.drafting import layer_outputs
from ..decoding.versions import takes_logits_to_keep


def target_outputs(target, layer_ids: list[int], input_ids: torch.Tensor, valid: torch.Tensor):
    """Frozen target forward -> (features [R, L, m·d_t], final hidden [R, L, d_t]) for padded rows."""
    # the [R, L, V] logits would be thrown away (statistics come from the final hidden state): a quarter of a
    # SmolLM2 forward's time, skipped where the model takes transformers' logits_to_keep
    keep = {"logits_to_keep": 1} if takes_logits_to_keep(type(target)) else {}
    with torch.no_grad():
        out = target(input_ids=input_ids, attention_mask=valid.long(), output_hidden_states=True, **keep)
    feats = torch.cat(layer_outputs(out.hidden_states, layer_ids), dim=-1)
    return feats, out.hidden_states[-1]


def target_statistics(lm_head, final: torch.Tensor, chunk: int = 256):
    """final [..., L, d_t] -> (logsumexp [..., L] float32, argmax [..., L] long) of ``lm_head(final)``, the
    target's logits over its whole vocabulary, ``chunk`` positions at a time so the [chunk, V] logits are all
    that is ever held. ``final`` must already be in the head's dtype."""
    flat = final.reshape(-1, final.shape[-1])
    lse = torch.empty(flat.shape[0], dtype=torch.float32, device=final.device)
    top = torch.empty(flat.shape[0], dtype=torch.long, device=final.device)
    with torch.no_grad():
        for i in range(0, flat.shape[0], chunk):
            logits = lm_head(flat[i : i + chunk]).float()
            lse[i : i + chunk], top[i : i + chunk] = logits.logsumexp(-1), logits.argmax(-1)
    return lse.view(final.shape[:-1]), top.view(final.shape[:-1])


class FeatureCache:
    """``get(row)`` returns (features [L, m·d_t], final hidden [L, d_t], logsumexp [L], argmax [L]) for one row,
    from disk or computed and stored. The statistics are computed from the stored (rounded) final hidden state,
    so they normalise exactly the logits a step recomputes from it.

    The folder is keyed by the layer ids and storage dtype, so a draft reading other layers never reuses it.
    """

    KEYS = ("features", "final", "logsumexp", "argmax")

    def __init__(self, root: str | Path, target, layer_ids: list[int], dtype: torch.dtype = torch.float16):
        key = hashlib.sha1(f"{layer_ids}-{dtype}-{target.config.to_json_string()}".encode()).hexdigest()[:12]
        self.dir = Path(root) / key
        self.dir.mkdir(parents=True, exist_ok=True)
        self.target, self.layer_ids, self.dtype = target, list(layer_ids), dtype

    def _path(self, row: dict) -> Path:
        # Keyed by the tokens as well as the id: a row rewritten under the same id must not get stale features.
        key = json.dumps([row["id"], row["prompt_ids"], row["response_ids"]])
        return self.dir / (hashlib.sha1(key.encode()).hexdigest()[:20] + ".safetensors")

    def get(self, row: dict, max_length: int, device: torch.device):
        path = self._path(row)
        ids = (row["prompt_ids"] + row["response_ids"])[:max_length]
        if path.is_file():
            try:
                t = load_file(path)
                if t["features"].shape[0] >= len(ids):
                    return tuple(t[k][: len(ids)].to(device) for k in self.KEYS)
            except Exception:  # unreadable, or written before a key existed: computed again below
                pass
        x = torch.tensor([ids], device=device)
        feats, final = target_outputs(self.target, self.layer_ids, x, torch.ones_like(x, dtype=torch.bool))
        feats, final = feats[0].to(self.dtype), final[0].to(self.dtype)
        head = self.target.get_output_embeddings()
        lse, top = target_statistics(head, final.to(head.weight.dtype))
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # two runs sharing the cache may write the same row at once
        t = dict(zip(self.KEYS, (feats, final, lse, top), strict=True))
        save_file({k: v.cpu().contiguous() for k, v in t.items()}, str(tmp))
        tmp.replace(path)
        return tuple(t[k].to(device) for k in self.KEYS)
