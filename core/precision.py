"""Buffers that a dtype cast must not round.

``module.to(torch.bfloat16)`` casts every floating buffer. RoPE's inverse frequencies (up to
3.7e-3 relative error in bf16: radians of phase at 8K positions) and a router's balancing bias
must stay fp32 whatever the model's dtype. A module lists them in ``fp32_buffers``; ``_apply``
(behind ``.to()``, ``.cuda()``, ``.bfloat16()``, ``to_empty``) moves them to the new device but
keeps their fp32 values, taken from before the cast.
"""
from __future__ import annotations

import torch
from torch import nn


class KeepFP32Buffers(nn.Module):
    fp32_buffers: tuple = ()

    def _apply(self, fn, recurse=True):
        before = {n: self._buffers[n] for n in self.fp32_buffers if self._buffers.get(n) is not None}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new.dtype != torch.float32 and not new.is_meta:
                self._buffers[name] = old.to(device=new.device, dtype=torch.float32)
        return self
