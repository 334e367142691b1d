"""The draft's building blocks (Llama/Qwen3 naming): RMSNorm, rotary position embedding, and the decoder layer
whose attention reads the injected context keys/values beside the block's own.

Shapes: R rows, L context positions, γ' block slots, d = hidden_size, KV key/value heads, hd = head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_dspark import DSparkConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float() if dtype in (torch.float16, torch.bfloat16) else x
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """positions [R, L] -> cos, sin [R, 1, L, head_dim] (HF rotate-half convention)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim))
    freqs = positions.to(torch.float64)[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class DraftAttention(nn.Module):
    """Queries from the block only; keys/values are [W_K H_ctx ; W_K H_block] with RoPE at true positions."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.rope_theta = c.rope_theta
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else nn.Identity()

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:2], n, self.head_dim).transpose(1, 2)

    def key_values(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """x [R, L, d], ``rope`` (cos, sin) of its positions (:meth:`DSparkDraftModel.rope`) -> keys, values
        [R, KV, L, head_dim] (keys normed and rotated)."""
        cos, sin = (t.to(x.dtype) for t in rope)
        k = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), cos, sin)
        return k, self._heads(self.v_proj(x), self.num_kv_heads)

    def forward(self, x, rope, ctx_k, ctx_v, attn_mask=None):
        """x [R, γ', d] block states; ``rope`` (cos, sin) of their positions, the same for every layer (computed
        once a forward); ctx_k/ctx_v [R, KV, L, hd]; attn_mask [R, γ', L + γ'] bool or None."""
        cos, sin = rope = tuple(t.to(x.dtype) for t in rope)  # cast once: key_values' cast is then a no-op
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), cos, sin)
        k, v = self.key_values(x, rope)
        k, v = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)
        mask = None if attn_mask is None else attn_mask[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))


class DraftMLP(nn.Module):
    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """A pre-norm decoder layer (Llama/Qwen3 naming) whose attention also reads the injected context."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DraftAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DraftMLP(config)

    def forward(self, x, rope, ctx_k, ctx_v, attn_mask=None):
        x = x + self.self_attn(self.input_layernorm(x), rope, ctx_k, ctx_v, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))
