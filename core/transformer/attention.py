"""Gated GQA self-attention on THD input (Step-3.x): per-head RMSNorm on q and k before RoPE,
optional sliding window, and a head-wise sigmoid gate on each head's output before ``o_proj``."""
from __future__ import annotations

import torch
from torch import nn

from core.transformer.attention_backends import BACKENDS, DocLayout, resolve_backend
from core.transformer.attention_op import compiled_attention
from core.transformer.norm import RMSNorm
from core.transformer.rotary import apply_rotary


class GatedAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 window: int | None, softmax_scale: float, eps: float, backend: str = "auto"):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.window, self.scale, self.backend = window, softmax_scale, backend
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        self.g_proj = nn.Linear(hidden, num_heads, bias=False)  # one gate per head
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def forward(self, x_TH: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                layout: DocLayout) -> torch.Tensor:
        T = x_TH.shape[0]
        q = self.q_norm(self.q_proj(x_TH).view(T, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x_TH).view(T, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x_TH).view(T, self.num_kv_heads, self.head_dim)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        backend = resolve_backend(self.backend, q.device)
        if torch.compiler.is_compiling():  # inside a compiled layer: boundaries as tensors
            o_THD = compiled_attention(q, k, v, layout, self.window, self.scale, backend)
        else:
            o_THD = BACKENDS[backend](q, k, v, layout, self.window, self.scale)
        o_THD = o_THD * torch.sigmoid(self.g_proj(x_TH)).unsqueeze(-1)
        return self.o_proj(o_THD.reshape(T, self.num_heads * self.head_dim))
