"""Host plans of the context-parallel attention exchanges, from the whole pack's boundaries
(``CPShard``: host integers from the loader; nothing here reads a device).

A rank runs one attention call over *segments*: segment ``i`` is its local query rows
``[cu_q[i], cu_q[i+1])`` (one chunk of one document, padding included) against rows
``[cu_k[i], cu_k[i+1])`` of a key buffer, causal with the queries aligned to the *end* of the
keys (bottom-right, as flash-attention aligns ``seqlen_q < seqlen_k``). The key buffer is
``pool[key_index]``, where ``pool`` is

* full attention: the CP group's all-gathered K/V (rank-major, ``N x T / N`` rows); chunk ``j``
  of a document gets the document's prefix ``[0, (j + 1) c)`` (its own chunk last);
* sliding window ``w``: the local K/V followed by the halo rows received from each other rank
  (in rank order); chunk ``j`` gets the ``h = min(w - 1, j c)`` keys before it, from whichever
  ranks hold them (several when chunks are shorter than the window), then its own ``c`` rows. A
  chunk with no real query (all padding) gets no halo: its outputs are zeroed anyway.

``send[s]`` are the local rows rank ``s`` needs (sorted by pack position, each once), ``recv[o]``
how many rows come from rank ``o``: the same numbers on both sides, so every message's size is
known on the host before anything moves.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from core.context_parallel.shard import owners


@dataclass
class SegmentPlan:
    cu_q: list                  # local query rows of each segment (host ints)
    cu_k: list                  # key-buffer rows of each segment (host ints)
    key_index: np.ndarray       # [cu_k[-1]] rows of the pool that make the key buffer
    send: dict = field(default_factory=dict)  # sliding: CP rank -> local rows it needs (int64)
    recv: dict = field(default_factory=dict)  # sliding: CP rank -> rows received from it

    @property
    def max_q(self) -> int:
        return max((b - a for a, b in zip(self.cu_q[:-1], self.cu_q[1:])), default=0)

    @property
    def max_k(self) -> int:
        return max((b - a for a, b in zip(self.cu_k[:-1], self.cu_k[1:])), default=0)


def _chunks(cu_seqlens, cu_seqlens_padded, size: int, rank: int):
    """This rank's local chunks in order: (pack start of the chunk, chunk index j, size c,
    document start, real queries in the chunk)."""
    pad = np.asarray(cu_seqlens_padded, dtype=np.int64)
    real = np.diff(np.asarray(cu_seqlens, dtype=np.int64))
    out = []
    for start, length, n in zip(pad[:-1].tolist(), np.diff(pad).tolist(), real.tolist()):
        c = length // (2 * size)
        for j in (rank, 2 * size - 1 - rank):
            out.append((start + j * c, j, c, start, min(max(n - j * c, 0), c)))
    return out


def full_plan(shard) -> SegmentPlan:
    """Each local chunk against its document's prefix in the all-gathered K/V."""
    N, cu, pad = shard.size, shard.cu_seqlens, shard.cu_seqlens_padded
    rank_of, local_of = owners(pad, N)
    gathered = rank_of * (shard.total // N) + local_of  # pack position -> row of the gathered K/V
    cu_q, cu_k, parts = [0], [0], []
    for cstart, j, c, dstart, _ in _chunks(cu, pad, N, shard.rank):
        parts.append(gathered[dstart:cstart + c])
        cu_q.append(cu_q[-1] + c)
        cu_k.append(cu_k[-1] + cstart + c - dstart)
    return SegmentPlan(cu_q, cu_k, np.concatenate(parts) if parts else np.zeros(0, np.int64))


def _halo_positions(cu, pad, N: int, rank: int, window: int) -> list[np.ndarray]:
    """Pack positions of the halo of each of ``rank``'s local chunks, in its local order."""
    out = []
    for cstart, j, c, dstart, n_real in _chunks(cu, pad, N, rank):
        h = min(window - 1, cstart - dstart) if n_real else 0
        out.append(np.arange(cstart - h, cstart, dtype=np.int64))
    return out


def halo_plan(shard, window: int) -> SegmentPlan:
    """Each local chunk against the ``window - 1`` keys before it (its halo) and itself."""
    N, r, cu, pad = shard.size, shard.rank, shard.cu_seqlens, shard.cu_seqlens_padded
    rank_of, local_of = owners(pad, N)
    T_local = shard.total // N
    mine = _halo_positions(cu, pad, N, r, window)
    wanted = np.concatenate(mine) if mine else np.zeros(0, np.int64)
    recv_rows, recv, offset = {}, {}, T_local
    for o in range(N):  # what each other rank sends here: its rows of my halos, each once, sorted
        if o == r:
            continue
        rows = np.unique(wanted[rank_of[wanted] == o])
        if len(rows):
            recv_rows[o], recv[o] = (rows, offset), len(rows)
            offset += len(rows)
    send = {}
    for s in range(N):  # what I send: my rows of each other rank's halos
        if s == r:
            continue
        theirs = _halo_positions(cu, pad, N, s, window)
        want = np.concatenate(theirs) if theirs else np.zeros(0, np.int64)
        rows = np.unique(want[rank_of[want] == r])
        if len(rows):
            send[s] = local_of[rows]
    pool_of = np.full(shard.total, -1, dtype=np.int64)  # pack position -> row of the pool
    pool_of[shard.index] = np.arange(T_local)
    for rows, off in recv_rows.values():
        pool_of[rows] = off + np.arange(len(rows))
    cu_q, cu_k, parts = [0], [0], []
    local = 0
    for halo, (cstart, j, c, dstart, _) in zip(mine, _chunks(cu, pad, N, r)):
        parts += [pool_of[halo], np.arange(local, local + c, dtype=np.int64)]
        local += c
        cu_q.append(cu_q[-1] + c)
        cu_k.append(cu_k[-1] + len(halo) + c)
    return SegmentPlan(cu_q, cu_k, np.concatenate(parts) if parts else np.zeros(0, np.int64), send, recv)
