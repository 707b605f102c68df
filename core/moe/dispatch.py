"""Token dispatch: routed tokens -> rows grouped by expert -> back, weighted.

``permute``/``unpermute`` are pure local functions; a dispatcher adds communication around them.
``LocalDispatcher`` keeps every expert in this process; ``AllToAllDispatcher`` and
``AllGatherDispatcher`` move tokens to the expert-parallel rank that holds their experts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch._dynamo

from core.distributed.host_values import host_counts


@dataclass
class PermuteState:
    order: torch.Tensor       # [T*K] index into the flattened (token, k) slots, sorted by expert
    num_tokens: int


def permute(x_TH: torch.Tensor, experts_TK: torch.Tensor, num_experts: int):
    """Copies of each token, one per chosen expert, sorted by expert (stable). Counts by a
    fixed-size scatter (``bincount`` would read the largest id back to size its output)."""
    flat = experts_TK.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    x_NH = x_TH.index_select(0, order // experts_TK.shape[1])
    return x_NH, counts, PermuteState(order, x_TH.shape[0])


class _Combine(torch.autograd.Function):
    """``out[t] = sum_k w[t, k] * y[slot(t, k)]`` with the weights and the sum in fp32, but no
    fp32 ``[T*K, hidden]`` intermediate (one fp32 ``[T, hidden]`` accumulator and one
    ``[T, hidden]`` slice at a time) and no scattered atomic adds; backward keeps only the
    expert outputs in their own dtype."""

    @staticmethod
    def forward(ctx, y_NH, w_TK, order):
        T, K = w_TK.shape
        y_TKH = torch.empty_like(y_NH).index_copy_(0, order, y_NH).view(T, K, y_NH.shape[1])  # token order
        f32 = torch.promote_types(y_NH.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
        acc = torch.zeros(T, y_NH.shape[1], dtype=f32, device=y_NH.device)
        compiling = torch.compiler.is_compiling()
        for k in range(K):
            if compiling:  # torch 2.11 compiles an in-place update of the output to wrong gradients
                acc = torch.addcmul(acc, y_TKH[:, k].to(f32), w_TK[:, k, None].to(f32))
            else:
                acc.addcmul_(y_TKH[:, k].to(f32), w_TK[:, k, None].to(f32))
        ctx.save_for_backward(y_TKH, w_TK, order)
        return acc if acc.dtype == y_NH.dtype else acc.to(y_NH.dtype)  # acc itself, not .to's alias

    @staticmethod
    def backward(ctx, g_TH):
        y_TKH, w_TK, order = ctx.saved_tensors
        f32 = torch.promote_types(y_TKH.dtype, torch.float32)
        g = g_TH.to(f32)
        K = w_TK.shape[1]
        grad_w = torch.stack([(y_TKH[:, k].to(f32) * g).sum(-1) for k in range(K)], dim=1).to(w_TK.dtype)
        grad_y = torch.empty_like(y_TKH)  # filled a slice at a time: no K pieces beside the whole
        for k in range(K):
            grad_y[:, k] = w_TK[:, k, None].to(f32) * g
        return grad_y.flatten(0, 1).index_select(0, order), grad_w, None


def unpermute(y_NH: torch.Tensor, weights_TK: torch.Tensor, state: PermuteState) -> torch.Tensor:
    """Weighted sum over each token's experts: ``sum_k w[t, k] * y[slot(t, k)]`` (fp32 maths,
    output in the experts' dtype)."""
    return _Combine.apply(y_NH, weights_TK, state.order)


def _rows_vary(x: torch.Tensor) -> torch.Tensor:
    """Mark the row count of the experts' input as changing from batch to batch, so compiled
    experts (``--compile``) get one graph for any count instead of one per count."""
    torch._dynamo.maybe_mark_dynamic(x, 0)
    return x


class LocalDispatcher:
    """All experts live in this process. ``side()`` (the shared expert) runs first."""

    communicates = False  # no collective and no host read: may sit inside a compiled graph

    def __call__(self, x_TH, weights_TK, experts_TK, experts_module, side=lambda: None):
        out = side()
        x_NH, counts, state = permute(x_TH, experts_TK, experts_module.num_experts)
        return unpermute(experts_module(x_NH, counts), weights_TK, state), out


def sort_by_local_expert(recv_counts: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows arrive grouped by source rank, then local expert (``recv_counts[src, e]`` rows,
    ``total`` of them: a host int the all-to-all already needed). Returns the row order that
    groups them by local expert, then source, and the per-expert row counts, with no device read.
    Pure: e.g. counts [[1, 2], [3, 0]] -> order [0, 3, 4, 5, 1, 2], counts [4, 2]."""
    ep, E = recv_counts.shape
    flat = recv_counts.flatten()
    starts = torch.cumsum(flat, 0) - flat
    blocks = torch.arange(ep * E, device=flat.device).view(ep, E).T.flatten()  # (expert, source)
    sizes = flat[blocks]
    within = torch.arange(total, device=flat.device) - \
        torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes, output_size=total)
    return torch.repeat_interleave(starts[blocks], sizes, output_size=total) + within, recv_counts.sum(0)


def unsort_rows(y: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``out[order[i]] = y[i]``: rows back to the order ``order`` took them from, as a gather by
    the inverse order, whose backward keeps only the indices (``index_copy`` would keep ``y``, the
    experts' whole output, for the backward of its ``source``). E.g. y [a, b, c], order [2, 0, 1]
    -> [b, c, a]."""
    inverse = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))
    return y.index_select(0, inverse)


@dataclass
class Dispatched:
    """A micro-batch chunk's tokens between the phases of :class:`AllToAllDispatcher`: permuted
    and sent (``dispatch_start``), received (``dispatch_wait``), through the experts and sent back
    (``combine_start``), weighted and summed (``combine_wait``)."""

    state: PermuteState
    weights_TK: torch.Tensor
    recv_counts: torch.Tensor   # [source rank, local expert]
    there: object               # AllToAllInFlight: the tokens' trip to their experts
    back: object                # AllToAllInFlight: the expert outputs' trip home
    rows: torch.Tensor | None   # in flight: the tokens' rows, then the expert outputs' (None between)
    order: torch.Tensor | None = None         # received rows -> grouped by local expert (dispatch_wait)
    local_counts: torch.Tensor | None = None  # rows per local expert


class AllToAllDispatcher:
    """Expert parallelism: each EP rank holds ``E / ep`` experts. Counts are exchanged first,
    then the token rows (uneven splits, zero allowed), then rows are regrouped by local expert;
    the way back mirrors it. The phases (``dispatch_start`` -> ``dispatch_wait`` ->
    ``combine_start``, the experts and the way home, -> ``combine_wait``) let a schedule run other compute
    while either all-to-all is in flight, in the forward and in the backward
    (``core/moe/overlap.py``); called whole, it runs them back to back with the shared expert
    beside the dispatch."""

    communicates = True  # reads split sizes on the host: stays outside compiled graphs

    def __init__(self, group, ep_size: int, num_experts: int):
        self.group, self.ep, self.num_experts = group, ep_size, num_experts
        self.sent_bytes = 0  # bytes this rank sent to other ranks in forward; backward as many
        self.record = None   # a CommRecord (core/distributed/collectives.py) to fill, when asked
        self.tag = ""        # names this layer's all-to-alls in ``record``

    def __call__(self, x_TH, weights_TK, experts_TK, experts_module, side=lambda: None):
        """``(routed output, side())``: ``side`` (the shared expert) runs while the tokens'
        all-to-all is in flight."""
        d = self.dispatch_start(x_TH, weights_TK, experts_TK)
        side_out = side()
        self.combine_start(d, experts_module, self.dispatch_wait(d))
        return self.combine_wait(d), side_out

    def dispatch_start(self, x_TH, weights_TK, experts_TK, chunk: str = "") -> Dispatched:
        """Permute, exchange the counts and start sending the rows: the one host read of an MoE
        layer (per chunk) is here, the split sizes the all-to-all needs."""
        import torch.distributed as dist

        from core.distributed.collectives import AllToAllInFlight, all_to_all_start, recorded

        x_NH, counts, state = permute(x_TH, experts_TK, self.num_experts)
        send_counts = counts.view(self.ep, -1)                     # [dest rank, local expert]
        recv_counts = torch.empty_like(send_counts)
        tag = f"{self.tag}{chunk}"
        recorded(self.record, tag, "counts", lambda: dist.all_to_all_single(recv_counts, send_counts, group=self.group))
        # (a traced step: the planner's balanced routing, core/distributed/host_values.py)
        send, recv = host_counts(torch.stack([send_counts.sum(1), recv_counts.sum(1)]), 2 * x_NH.shape[0])
        me = dist.get_rank(self.group)  # rows kept on this rank cross no wire
        self.sent_bytes += x_NH.shape[1] * x_NH.element_size() * (sum(send) - send[me] + sum(recv) - recv[me])
        there = AllToAllInFlight(send, recv, self.group, self.record, tag + ".dispatch")
        back = AllToAllInFlight(recv, send, self.group, self.record, tag + ".combine")
        return Dispatched(state, weights_TK, recv_counts, there, back, all_to_all_start(x_NH, there))

    def dispatch_wait(self, d: Dispatched) -> torch.Tensor:
        """The rows this rank's experts receive (they arrive grouped by source rank, then local
        expert), regrouped by local expert; the received buffer is not held past the regrouping."""
        from core.distributed.collectives import all_to_all_wait

        rows, d.rows = d.rows, None
        d.order, d.local_counts = sort_by_local_expert(d.recv_counts, sum(d.there.splits[1]))
        return all_to_all_wait(rows, d.there).index_select(0, d.order)

    def combine_start(self, d: Dispatched, experts_module, x_sorted: torch.Tensor, after=None) -> None:
        """Run the local experts on ``dispatch_wait``'s rows and start sending the outputs home
        (``after``: applied to the experts' output first, e.g. an autograd marker). The experts'
        output is not held past its reordering, nor the rows in flight past the waits (NCCL's
        Work keeps the send buffer until then)."""
        from core.distributed.collectives import all_to_all_start

        y = experts_module(_rows_vary(x_sorted), d.local_counts)
        y = unsort_rows(y if after is None else after(y), d.order)
        d.rows = all_to_all_start(y, d.back)

    def combine_wait(self, d: Dispatched) -> torch.Tensor:
        """The routed output ``[T, hidden]``: each token's expert outputs, weighted and summed."""
        from core.distributed.collectives import all_to_all_wait

        rows, d.rows = d.rows, None
        return unpermute(all_to_all_wait(rows, d.back), d.weights_TK, d.state)


class AllGatherDispatcher:
    """The simple alternative: every EP rank sees every token of its EP group, applies its own
    experts, and a reduce-scatter sums the contributions back to each token's rank. Needs the
    same T on every rank (THD guarantees it). Its one host read per layer: how many of the
    gathered (token, expert) slots are this rank's (the rows its experts receive), as the
    all-to-all reads its split sizes; the slots are sorted and counted with fixed sizes (no
    ``nonzero``, no ``bincount``)."""

    communicates = True

    def __init__(self, group, ep_size: int, ep_rank: int, num_experts: int):
        self.group, self.ep = group, ep_size
        self.local = num_experts // ep_size
        self.offset = ep_rank * self.local

    def __call__(self, x_TH, weights_TK, experts_TK, experts_module, side=lambda: None):
        from core.distributed.collectives import all_gather, all_gather_into, reduce_scatter

        K = experts_TK.shape[1]
        x_all = all_gather(x_TH, self.group)
        w_all = all_gather(weights_TK, self.group)
        e_all = torch.empty(self.ep * experts_TK.shape[0], K, dtype=experts_TK.dtype, device=experts_TK.device)
        all_gather_into(e_all, experts_TK.contiguous(), self.group)  # ids: no gradient
        local = e_all.flatten() - self.offset
        key = torch.where((local >= 0) & (local < self.local), local, self.local)  # others' experts: last
        order = torch.argsort(key, stable=True)  # this rank's slots first, by expert, then token order
        counts = torch.zeros(self.local + 1, dtype=torch.int64, device=key.device).scatter_add_(
            0, key, torch.ones_like(key))
        n = host_counts(counts[:self.local].sum().reshape(1), e_all.numel() // self.ep)[0]  # the one host read
        slots = order[:n]
        y = experts_module(_rows_vary(x_all.index_select(0, slots // K)), counts[:self.local])
        w = w_all.flatten().index_select(0, slots)
        out = x_all.new_zeros(x_all.shape).index_add(0, slots // K, (y * w[:, None]).to(y.dtype))
        return reduce_scatter(out, self.group), side()
