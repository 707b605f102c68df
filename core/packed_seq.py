"""The THD contract: metadata that travels with a packed micro-batch.

A micro-batch is ``T`` tokens made of several documents laid end to end. ``cu_seqlens`` marks
the real document boundaries; ``cu_seqlens_padded`` the same boundaries after each document is
padded to a multiple of ``pad_multiple`` and the pack's trailing pad folded into its last
document, so ``cu_seqlens_padded[-1] == T`` always. Attention never crosses a boundary.

Under context parallelism a micro-batch is one CP rank's shard: the boundaries are the shard's
(``core/context_parallel/shard.py``) and ``cp`` holds the whole pack's, with what was computed
on the whole pack before it was cut.

The same boundaries also travel as host integers (``host_cu_seqlens``, ``host_cu_seqlens_padded``),
taken from the loader's CPU tensors and kept when the tensors move to the GPU, so code that
needs a length on the host (kernel arguments, loop bounds) never reads device memory.
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
    host_cu_seqlens: tuple | None = None         # cu_seqlens as Python ints (from the loader)
    host_cu_seqlens_padded: tuple | None = None  # cu_seqlens_padded as Python ints
    cp: object = None  # context parallelism: this rank's core.context_parallel.shard.CPShard

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
        if self.host_cu_seqlens is None and self.cu_seqlens.device.type == "cpu":
            self.host_cu_seqlens = tuple(self.cu_seqlens.tolist())  # host memory: no sync
            self.host_cu_seqlens_padded = tuple(self.cu_seqlens_padded.tolist())

    def host_boundaries(self) -> tuple[tuple, tuple]:
        """(cu_seqlens, cu_seqlens_padded) as Python ints; reads the device only when built
        without host copies (not through the loader)."""
        if self.host_cu_seqlens is None:
            return tuple(self.cu_seqlens.tolist()), tuple(self.cu_seqlens_padded.tolist())
        return self.host_cu_seqlens, self.host_cu_seqlens_padded

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PackedSeqParams":
        return PackedSeqParams(self.cu_seqlens.to(device, non_blocking=non_blocking),
                               self.cu_seqlens_padded.to(device, non_blocking=non_blocking),
                               self.max_seqlen, self.qkv_format, *self.host_boundaries(),
                               cp=None if self.cp is None else self.cp.to(device, non_blocking))
