"""A context-parallel rank's shard of a THD micro-batch (``core/context_parallel/shard.py``).

Every CP rank of a data-parallel rank builds the same micro-batch on the host (its loader is
the data-parallel rank's), computes labels, position ids and the MTP depths' shifted inputs and
targets on the whole pack, and keeps its two chunks of every document. The pack plan was made
with each document padded to a multiple of ``2 x cp`` (``pad_multiple``), so the cut needs no
data from other ranks and T / cp is the same on every rank and step.

Images (image + text packs): every CP rank keeps all the micro-batch's images and encodes them
(duplicated vision work, no communication, exact); the tower's gradients are summed over the CP
ranks by the dense gradient reduction (dp x cp), and each rank's loss reaches only the features
it writes. On the host, the whole pack's ``feature_positions`` become this shard's local
positions of the placeholders it holds, with ``feature_index``: which of the tower's features
goes to each (``shard_images``). A shard holding no placeholder gets no images: its model runs
the idle pass (``models/step37/vision.py``), so it still issues the tower's collectives (FSDP)
as the other CP ranks do, at the cost of one 5 x 5-patch image."""
from __future__ import annotations

import numpy as np
import torch

from core.context_parallel.shard import (CPShard, check_divisible, local_boundaries, mtp_shifts,
                                         real_end, shard_positions)
from core.packed_seq import ImageInputs, PackedSeqParams
from data.loader import THDLoader
from data.thd import THDBatch


def shard_batch(batch: THDBatch, size: int, rank: int, mtp_depths: int = 0) -> THDBatch:
    """CP rank ``rank`` of ``size``'s part of ``batch`` (a whole micro-batch); ``mtp_depths``:
    how many multi-token-prediction depths get shifted inputs and targets."""
    p = batch.packed_seq_params
    cu, pad = p.host_boundaries()
    check_divisible(pad, size)
    index = shard_positions(pad, size, rank)
    pick = torch.from_numpy(index)
    tokens = batch.tokens.numpy()
    valid = np.arange(len(tokens)) < real_end(cu, pad)
    inputs = labels = None
    if mtp_depths:
        inputs, labels = (torch.from_numpy(a[:, index]) for a in
                          mtp_shifts(tokens, batch.labels.numpy(), cu, pad, mtp_depths))
    local_cu, local_pad = local_boundaries(cu, pad, size, rank)
    shard = CPShard(size, rank, tuple(cu), tuple(pad), index, torch.from_numpy(valid[index]), inputs, labels)
    params = PackedSeqParams(torch.tensor(local_cu, dtype=torch.int32), torch.tensor(local_pad, dtype=torch.int32),
                             p.max_seqlen, cp=shard)
    return THDBatch(batch.tokens[pick], batch.labels[pick], batch.position_ids[pick], params,
                    shard_images(batch.images, index))


def shard_images(images: ImageInputs | None, index: np.ndarray) -> ImageInputs | None:
    """The images of a CP shard whose local tokens sit at pack positions ``index`` (ascending):
    all the pack's images, the local positions of the placeholders the shard holds and which of
    the tower's features each takes; None when the shard holds no placeholder (module docstring)."""
    if images is None:
        return None
    if images.feature_index is not None:
        raise ValueError("shard_images: these images are already a CP shard's")
    whole = images.feature_positions.numpy()
    local = np.searchsorted(index, whole)
    held = local < len(index)
    held[held] = index[local[held]] == whole[held]
    if not held.any():
        return None
    keep = np.flatnonzero(held)
    return ImageInputs(images.pixel_values, images.pixel_values_local, images.num_local_patches,
                       torch.from_numpy(local[keep]), torch.from_numpy(keep), len(whole))


class CPShardLoader(THDLoader):
    """:class:`THDLoader` of one data-parallel rank whose micro-batches are CP rank ``cp_rank``'s
    shards (the stream, its state and its resumption are the data-parallel loader's)."""

    def __init__(self, sources, *, cp_size: int, cp_rank: int, mtp_depths: int = 0, **kwargs):
        super().__init__(sources, **kwargs)
        if self.pad_multiple % (2 * cp_size) or self.seq_length % (2 * cp_size):
            raise ValueError(f"--context-parallel-size {cp_size}: documents must be padded to a "
                             f"multiple of {2 * cp_size} (--document-pad-multiple, now {self.pad_multiple}) "
                             f"and --seq-length {self.seq_length} must be one")
        self.cp_size, self.cp_rank, self.mtp_depths = cp_size, cp_rank, mtp_depths

    def micro_batch(self, m: int) -> THDBatch:
        return shard_batch(super().micro_batch(m), self.cp_size, self.cp_rank, self.mtp_depths)
