"""SwiGLU feed-forward with the optional Step-3.x clamp:
``down(silu(gate(x)).clamp(max=L) * up(x).clamp(-L, L))``."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    g = F.silu(gate)
    if limit is not None:
        g = g.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return g * up


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, limit: float | None = None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))
