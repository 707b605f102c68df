"""A context-parallel rank's shard of a THD micro-batch (``core/context_parallel/shard.py``).

Every CP rank of a data-parallel rank builds the same micro-batch on the host (its loader is
the data-parallel rank's), computes labels, position ids and the MTP depths' shifted inputs and
targets on the whole pack, and keeps its two chunks of every document. The pack plan was made
with each document padded to a multiple of ``2 x cp`` (``pad_multiple``), so the cut needs no
data from other ranks and T / cp is the same on every rank and step.

Images (image + text packs): every CP rank keeps the whole micro-batch's ``ImageInputs``
unchanged, its ``feature_positions`` indexing the whole pack's ``T`` tokens (not the shard's).
Each rank encodes every image of the pack (redundant vision work, no communication, exact) and
keeps the features whose positions it holds: ``packed_seq_params.cp.index`` gives the pack
position of each local token (host ints), so the local placement is a host computation."""
from __future__ import annotations

import numpy as np
import torch

from core.context_parallel.shard import (CPShard, check_divisible, local_boundaries, mtp_shifts,
                                         real_end, shard_positions)
from core.packed_seq import PackedSeqParams
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
                    batch.images)  # whole-pack images and positions (module docstring)


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
