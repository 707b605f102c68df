"""GQA self-attention on THD input, with the options families use: per-head RMSNorm on q and k
before RoPE (``qk_norm``, in either RMSNorm form), an optional sliding window, projection biases,
and an optional head-wise sigmoid gate on each head's output before ``o_proj`` (Step-3.x's
``g_proj``: hidden -> one gate per head)."""
from __future__ import annotations

import torch
from torch import nn

from core.transformer.attention_backends import BACKENDS, DocLayout, resolve_backend
from core.transformer.attention_op import compiled_attention
from core.transformer.norm import RMSNorm
from core.transformer.rotary import apply_rotary


class Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 window: int | None, softmax_scale: float, eps: float, backend: str = "auto",
                 gate: bool = False, qk_norm: bool = True, norm_offset: bool = True, bias: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.window, self.scale, self.backend = window, softmax_scale, backend
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=bias)
        self.g_proj = nn.Linear(hidden, num_heads, bias=False) if gate else None  # one gate per head
        self.q_norm = RMSNorm(head_dim, eps, offset=norm_offset) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps, offset=norm_offset) if qk_norm else None

    def forward(self, x_TH: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                layout: DocLayout) -> torch.Tensor:
        T = x_TH.shape[0]
        q = self.q_proj(x_TH).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x_TH).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x_TH).view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        backend = resolve_backend(self.backend, q.device)
        if torch.compiler.is_compiling():  # inside a compiled layer: boundaries as tensors
            o_THD = compiled_attention(q, k, v, layout, self.window, self.scale, backend)
        else:
            o_THD = BACKENDS[backend](q, k, v, layout, self.window, self.scale)
        if self.g_proj is not None:
            o_THD = o_THD * torch.sigmoid(self.g_proj(x_TH)).unsqueeze(-1)
        return self.o_proj(o_THD.reshape(T, self.num_heads * self.head_dim))
