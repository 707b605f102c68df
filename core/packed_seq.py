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


@dataclass
class ImageInputs:
    """The images of one micro-batch, as the first pipeline stage's vision tower takes them.

    ``pixel_values`` holds every image's global view, in the order the images appear in the
    micro-batch's tokens; ``pixel_values_local`` every image's crops, image by image (``None``
    when no image has crops); ``num_local_patches`` the crops per image (host ints). The tower's
    features are taken per image as its crops' features then its global view's (transformers'
    ``Step3p7Model.get_image_features`` order) and written over the embeddings at
    ``feature_positions``: int64 ``[F]``, indices into the micro-batch's ``T`` tokens of every
    image placeholder, ascending, made on the host by the loader (so writing them needs no
    device sync). ``F`` equals the tower's feature count, which is checked on the host.

    Under context parallelism a micro-batch is one CP rank's shard of a pack, yet its
    ``ImageInputs`` hold every image of the pack (each CP rank encodes them all: no
    communication). ``feature_positions`` then index the shard's ``T / cp`` tokens and hold only
    the placeholders the shard holds, and ``feature_index`` (int64 ``[F_local]``, made on the
    host by ``data/cp_shard.py``) says which of the tower's ``num_features`` features (a host
    int) goes to each: ``feats.index_select(0, feature_index)`` is written at
    ``feature_positions``. ``feature_index`` None (the default; always without CP) means all the
    tower's features, in order.

    ``ImageInputs.idle()`` holds no image: a first-stage micro-batch without images whose step
    has images on another rank of the stage's data-parallel group (``core/train_step.py``) gets
    it, so that a sharded tower runs its collectives idle, in step with that rank's real pass. A
    micro-batch gets no ``ImageInputs`` at all when no rank of the group has an image that step:
    the tower runs nowhere.
    """
    pixel_values: torch.Tensor                # float32 (bf16 under --bf16) [N, 3, S, S]
    pixel_values_local: torch.Tensor | None   # as pixel_values, [M, 3, P, P], M == sum(num_local_patches)
    num_local_patches: tuple                  # N host ints
    feature_positions: torch.Tensor           # int64 [F] (under CP: [F_local], shard indices)
    feature_index: torch.Tensor | None = None  # int64 [F_local]: the tower's features kept (CP)
    num_features: int | None = None           # host int: the tower's feature count, with feature_index

    def __post_init__(self) -> None:
        n = self.pixel_values.shape[0]
        if len(self.num_local_patches) != n:
            raise ValueError(f"ImageInputs: {n} global views but {len(self.num_local_patches)} "
                             "crop counts")
        m = 0 if self.pixel_values_local is None else self.pixel_values_local.shape[0]
        if m != sum(self.num_local_patches):
            raise ValueError(f"ImageInputs: {m} crops but num_local_patches sums to "
                             f"{sum(self.num_local_patches)}")
        if self.feature_positions.dtype != torch.int64 or self.feature_positions.dim() != 1:
            raise ValueError("ImageInputs.feature_positions must be a 1-D int64 tensor")
        if self.feature_index is not None:
            if self.feature_index.dtype != torch.int64 or self.feature_index.dim() != 1 or \
                    self.feature_index.shape[0] != self.feature_positions.shape[0]:
                raise ValueError("ImageInputs.feature_index must be a 1-D int64 tensor as long as "
                                 f"feature_positions ({self.feature_positions.shape[0]})")
            if not isinstance(self.num_features, int):
                raise ValueError("ImageInputs.num_features (a host int) must come with feature_index")

    @classmethod
    def idle(cls, device: torch.device | str = "cpu") -> "ImageInputs":
        """No image: the tower runs idle (the class docstring)."""
        return cls(torch.empty(0, 3, 0, 0, device=device), None, (),
                   torch.empty(0, dtype=torch.int64, device=device))

    @property
    def is_idle(self) -> bool:
        return not self.num_local_patches  # no image (a host fact)

    @property
    def tower_features(self) -> int:
        """How many features the tower must give for these images (host int: no device read)."""
        return self.feature_positions.shape[0] if self.feature_index is None else self.num_features

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "ImageInputs":
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)
        return ImageInputs(move(self.pixel_values), move(self.pixel_values_local), self.num_local_patches,
                           move(self.feature_positions), move(self.feature_index), self.num_features)
