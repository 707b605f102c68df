"""RMSNorm, computed in fp32, in the two forms models use:

* ``offset=True`` (Gemma / Step-3.x): ``(y * (1 + w)).to(dtype)``, ``w`` initialised to 0;
* ``offset=False`` (Llama / Qwen): ``w * y.to(dtype)``, ``w`` initialised to 1,

with ``y = x / rms(x)`` in fp32. Each keeps the exact operation order of its reference (the
product before the cast, or the cast before it), so bf16 outputs match it bit for bit.
"""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, *, offset: bool = True):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def constant_init(self) -> dict[str, float]:
        """The initial weight that makes the norm a plain normalisation (``core/init.py``)."""
        return {"weight": 0.0 if self.offset else 1.0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(self.normalize(x), self.weight, self.offset, x.dtype)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """``x / rms(x)`` in fp32."""
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)

    @staticmethod
    def scale(y: torch.Tensor, weight: torch.Tensor, offset: bool, dtype: torch.dtype) -> torch.Tensor:
        """The weight applied to the normalised ``y``, output in ``dtype`` (the input's)."""
        if not offset:
            return weight * y.to(dtype)
        # scale before casting back: (x * (1 + w)).to(dtype), not x.to(dtype) * (1 + w)
        return (y * (1.0 + weight.float())).to(dtype)
