"""The THD contract: metadata that travels with a packed micro-batch.

A micro-batch is ``T`` tokens made of several documents laid end to end. ``cu_seqlens`` marks
the real document boundaries; ``cu_seqlens_padded`` the same boundaries after each document is
padded to a multiple of ``pad_multiple`` and the pack's trailing pad folded into its last
document, so ``cu_seqlens_padded[-1] == T`` always. Attention never crosses a boundary.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedSeqParams:
    cu_seqlens: torch.Tensor          # int32 [n_docs + 1], real lengths
    cu_seqlens_padded: torch.Tensor   # int32 [n_docs + 1], padded; last entry == T
    max_seqlen: int                   # longest real document (Python int: no device sync)
    qkv_format: str = "thd"

    def __post_init__(self) -> None:
        for name in ("cu_seqlens", "cu_seqlens_padded"):
            t = getattr(self, name)
            if t.dtype != torch.int32 or t.dim() != 1:
                raise ValueError(f"PackedSeqParams.{name} must be a 1-D int32 tensor, "
                                 f"got {t.dtype} with shape {tuple(t.shape)}")
        if self.cu_seqlens.numel() != self.cu_seqlens_padded.numel():
            raise ValueError("PackedSeqParams: cu_seqlens and cu_seqlens_padded differ in length "
                             f"({self.cu_seqlens.numel()} vs {self.cu_seqlens_padded.numel()})")
        if self.qkv_format != "thd":
            raise ValueError(f"PackedSeqParams.qkv_format must be 'thd', got {self.qkv_format!r}")

    def to(self, device: torch.device | str) -> "PackedSeqParams":
        return PackedSeqParams(self.cu_seqlens.to(device), self.cu_seqlens_padded.to(device),
                               self.max_seqlen, self.qkv_format)
