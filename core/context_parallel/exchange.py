"""The context-parallel exchanges of K/V, differentiable (autograd runs the transpose). What
moves is per-token rows: K and V, or multi-head latent attention's compressed latent
(``[T/N, kv_lora_rank + rope]``, expanded to K/V after the exchange: ``attention.py``).

* Full-attention layers: one all-gather of the local ``[T/N, 2 Hkv, D]`` K/V over the CP group
  (``core.distributed.collectives.all_gather``); its backward reduce-scatters dK/dV to the ranks
  that own them. The gathered K/V stay alive for the attention's backward (autograd keeps the
  key buffer the kernel read: ``(1 + 1/2N) x T`` rows of K and of V per full layer); under
  ``--recompute-granularity full`` or ``selective`` only the layer's input is kept and the
  recompute gathers again.
* Sliding-window layers: the halo. Each rank sends every other rank the rows of its K/V that
  fall in that rank's halos and receives its own, all in one ``batch_isend_irecv`` over the CP
  group, ordered by peer, one message per ordered pair of ranks (sizes from the host plan,
  ``core/context_parallel/plan.py``; empty messages are not sent). Within one batch NCCL
  completes the operations together, so the exchange cannot deadlock even when every send
  blocks until its receive is posted, and with one message per pair NCCL's in-order matching
  (tags ignored) cannot pair the wrong tensors. The backward is the same exchange reversed: the
  halo rows' gradients go back to their owners and are added to theirs.

``CPComm.trace`` (when a list) records what each exchange issued, as the pipeline's
``P2POp`` records, so tests replay it under NCCL's rules (``core/pipeline/nccl_replay.py``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from core.pipeline.p2p import P2POp


class CPComm:
    """The CP group of this rank: its process group, global ranks and place in it."""

    def __init__(self, group, ranks: list[int], rank: int):
        self.group, self.ranks, self.rank = group, list(ranks), rank
        self.size = len(self.ranks)
        self.exchanges = 0   # halo exchanges run so far (the same count on every CP rank)
        self.trace: list | None = None  # set to [] to record (tests)
        self.halo_bytes = 0  # bytes this rank sent in halo exchanges

    def exchange(self, sends: dict, recvs: dict, tag: str) -> None:
        """Send ``sends[s]`` to CP rank ``s`` and receive ``recvs[o]`` from CP rank ``o`` (filled
        in place), in one batch ordered by peer."""
        seq, self.exchanges = self.exchanges, self.exchanges + 1
        ops, issued = [], []
        me = self.ranks[self.rank]
        for peer in sorted(set(sends) | set(recvs)):
            g = self.ranks[peer]
            if peer in sends:
                t = sends[peer]
                ops.append(dist.P2POp(dist.isend, t, g, self.group))
                issued.append(P2POp("send", g, (tag, seq, g), tuple(t.shape), str(t.dtype)))
                self.halo_bytes += t.numel() * t.element_size()
            if peer in recvs:
                t = recvs[peer]
                ops.append(dist.P2POp(dist.irecv, t, g, self.group))
                issued.append(P2POp("recv", g, (tag, seq, me), tuple(t.shape), str(t.dtype)))
        if self.trace is not None:
            self.trace.append(issued)
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()  # on GPU: the compute stream waits for NCCL's, the host does not


class _Halo(torch.autograd.Function):
    """``[local K/V rows, rows received from each other rank in rank order]``."""

    @staticmethod
    def forward(ctx, kv, send: dict, recv: dict, comm: CPComm):
        ctx.send, ctx.recv, ctx.comm, ctx.rows = send, recv, comm, kv.shape[0]
        sends = {s: kv.index_select(0, idx) for s, idx in send.items()}
        recvs = {o: kv.new_empty(n, *kv.shape[1:]) for o, n in recv.items()}
        comm.exchange(sends, recvs, "H")
        return torch.cat([kv, *(recvs[o] for o in sorted(recvs))])

    @staticmethod
    def backward(ctx, g):
        grad = g[:ctx.rows].clone()
        back, off = {}, ctx.rows
        for o in sorted(ctx.recv):
            back[o] = g[off:off + ctx.recv[o]].contiguous()
            off += ctx.recv[o]
        theirs = {s: g.new_empty(len(idx), *g.shape[1:]) for s, idx in ctx.send.items()}
        ctx.comm.exchange(back, theirs, "dH")
        for s, idx in ctx.send.items():
            grad.index_add_(0, idx, theirs[s])
        return grad, None, None, None


def halo_exchange(kv: torch.Tensor, send: dict, recv: dict, comm: CPComm) -> torch.Tensor:
    """The sliding-window pool: local K/V rows then the halo rows from each other CP rank."""
    return _Halo.apply(kv, send, recv, comm)
