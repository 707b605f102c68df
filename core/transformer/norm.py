"""RMSNorm as Step-3.x (Gemma-style): computed in fp32, scaled by ``1 + weight`` (zero-init)."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        # scale before casting back: (x * (1 + w)).to(dtype), not x.to(dtype) * (1 + w)
        return (y * (1.0 + self.weight.float())).type_as(x)
