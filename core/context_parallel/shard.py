"""Which tokens of a THD micro-batch each context-parallel rank holds, and the targets computed
on the whole pack before it is cut (host code, NumPy; part of the THD contract: ``data`` calls it).

Every document is padded (at its tail) to a multiple of ``2N`` and cut into ``2N`` chunks of
``c = L / 2N`` tokens; CP rank ``r`` holds chunks ``r`` and ``2N - 1 - r`` of every document, in
pack order. Under causal attention chunk ``j`` costs about ``j + 1/2``, so every rank gets the
same work (Megatron's and Transformer Engine's split). A rank's shard is itself a THD layout:
document ``d`` of padded length ``L`` becomes ``L / N`` local tokens, so the local padded
boundaries are the pack's divided by ``N``. Hand-worked (N = 2, documents of 7 and 3 real
tokens, padded to 8 and 4)::

    pack positions   0 1 2 3 4 5 6 7 | 8 9 10 11
    chunk            0 0 1 1 2 2 3 3 | 0 1 2  3
    rank 0 holds     0 1         6 7 | 8      11    local cu_seqlens_padded [0, 4, 6]
    rank 1 holds         2 3 4 5     |   9 10       local cu_seqlens_padded [0, 4, 6]

Labels, position ids and the multi-token-prediction depths' shifted inputs and targets are
computed on the whole pack (``mtp_shifts``) and then cut like the tokens, so no rank ever rolls
a tensor across a shard or a document boundary (the bug of Megatron-LM PR #4495).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

IGNORE_INDEX = -100


@dataclass
class CPShard:
    """A CP rank's part of one micro-batch: the whole pack's host boundaries (what the attention
    exchanges are planned from), the pack position of every local token, and device tensors
    computed on the whole pack: the local real-token mask and the MTP depths' shifted inputs and
    targets. ``plans`` caches the exchange plans of the micro-batch (one per window), built on
    the host the first time a layer needs them and shared by every layer, chunk and recompute."""

    size: int                     # N, the CP group's size
    rank: int                     # this rank's place in the CP group
    cu_seqlens: tuple             # the whole pack's real boundaries (host ints)
    cu_seqlens_padded: tuple      # the whole pack's padded boundaries (host ints, multiples of 2N)
    index: np.ndarray             # [T / N] int64: pack position of each local token
    valid: torch.Tensor           # [T / N] bool: local real tokens
    mtp_inputs: torch.Tensor | None = None  # [D, T / N] int64: depth k's input token (0: none)
    mtp_labels: torch.Tensor | None = None  # [D, T / N] int64: depth k's target (-100: none)
    plans: dict = field(default_factory=dict, repr=False)

    @property
    def total(self) -> int:
        """T, the whole micro-batch's tokens."""
        return self.cu_seqlens_padded[-1]

    def to(self, device, non_blocking: bool = False) -> "CPShard":
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)
        return CPShard(self.size, self.rank, self.cu_seqlens, self.cu_seqlens_padded, self.index,
                       move(self.valid), move(self.mtp_inputs), move(self.mtp_labels))


def check_divisible(cu_seqlens_padded, size: int) -> None:
    """``ValueError`` unless every padded document length is a multiple of ``2 * size``."""
    lengths = np.diff(np.asarray(cu_seqlens_padded, dtype=np.int64))
    bad = np.flatnonzero(lengths % (2 * size))
    if len(bad):
        raise ValueError(f"--context-parallel-size {size}: document {int(bad[0])} has padded length "
                         f"{int(lengths[bad[0]])}, not a multiple of 2 x {size}; pack with "
                         f"--document-pad-multiple a multiple of {2 * size} and a --seq-length that it divides")


def shard_positions(cu_seqlens_padded, size: int, rank: int) -> np.ndarray:
    """Pack positions of CP rank ``rank``'s tokens, in its local order: for each document,
    chunk ``rank`` then chunk ``2 * size - 1 - rank``."""
    if not 0 <= rank < size:
        raise ValueError(f"CP rank {rank} must be in [0, {size})")
    cu = np.asarray(cu_seqlens_padded, dtype=np.int64)
    starts, c = cu[:-1], np.diff(cu) // (2 * size)
    parts = []
    for s, n in zip(starts.tolist(), c.tolist()):
        parts.append(np.arange(s + rank * n, s + (rank + 1) * n))
        parts.append(np.arange(s + (2 * size - 1 - rank) * n, s + (2 * size - rank) * n))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def owners(cu_seqlens_padded, size: int) -> tuple[np.ndarray, np.ndarray]:
    """For every pack position, ``(CP rank that holds it, its index in that rank's shard)``."""
    T = int(cu_seqlens_padded[-1])
    rank_of, local_of = np.empty(T, dtype=np.int64), np.empty(T, dtype=np.int64)
    for r in range(size):
        pos = shard_positions(cu_seqlens_padded, size, r)
        rank_of[pos], local_of[pos] = r, np.arange(len(pos))
    return rank_of, local_of


def real_end(cu_seqlens, cu_seqlens_padded) -> np.ndarray:
    """For every pack position, one past the last real token of its document (``[T]``)."""
    cu, pad = np.asarray(cu_seqlens, dtype=np.int64), np.asarray(cu_seqlens_padded, dtype=np.int64)
    widths = np.diff(pad)
    return np.repeat(pad[:-1] + np.diff(cu), widths)


def mtp_shifts(tokens: np.ndarray, labels: np.ndarray, cu_seqlens, cu_seqlens_padded,
               depths: int) -> tuple[np.ndarray, np.ndarray]:
    """Depth ``k`` (1..D)'s input and target at every pack position ``t``: ``tokens[t + k]`` and
    ``labels[t + k]`` when ``t + k`` is a real token of ``t``'s document, else 0 and -100 (what
    the model's own roll over one unsharded pack gives, ``models/step37/model.py``). Returns two
    ``[D, T]`` int64 arrays."""
    T = len(tokens)
    end = real_end(cu_seqlens, cu_seqlens_padded)
    t = np.arange(T)
    inputs = np.zeros((depths, T), dtype=np.int64)
    targets = np.full((depths, T), IGNORE_INDEX, dtype=np.int64)
    for k in range(1, depths + 1):
        ok = t + k < end
        inputs[k - 1, ok] = tokens[t[ok] + k]
        targets[k - 1, ok] = labels[t[ok] + k]
    return inputs, targets


def local_boundaries(cu_seqlens, cu_seqlens_padded, size: int, rank: int) -> tuple[list, list]:
    """This rank's THD boundaries: padded ones are the pack's divided by ``size``; real ones
    accumulate each document's real tokens in this shard (a count: in a shard a document's real
    tokens need not come first)."""
    pad = np.asarray(cu_seqlens_padded, dtype=np.int64)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    c = np.diff(pad) // (2 * size)
    real = np.diff(cu)
    mine = np.zeros(len(real), dtype=np.int64)
    for j in (rank, 2 * size - 1 - rank):
        mine += np.clip(real - j * c, 0, c)
    return np.concatenate([[0], np.cumsum(mine)]).tolist(), (pad // size).tolist()


def unshard(parts: list, cu_seqlens_padded, size: int, dim: int = 0):
    """Inverse of cutting along ``dim`` by :func:`shard_positions`: ``parts[r]`` is rank r's
    shard (tensors or arrays; ``dim`` 0 for ``[T / N, ...]``, -1 for ``[D, T / N]``)."""
    T = int(cu_seqlens_padded[-1])
    first = parts[0]
    shape = list(first.shape)
    shape[dim] = T
    out = torch.empty(shape, dtype=first.dtype) if torch.is_tensor(first) else np.empty(shape, first.dtype)
    for r, part in enumerate(parts):
        pos = shard_positions(cu_seqlens_padded, size, r)
        if torch.is_tensor(part):
            pos = torch.from_numpy(pos)
        if dim == 0:
            out[pos] = part
        else:
            out[..., pos] = part
    return out
