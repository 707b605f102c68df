"""Differentiable collectives over an explicit process group (autograd runs the transpose)."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

# torch renamed these; use whichever this version has
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_scatter_from = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """Non-differentiable all-gather along dim 0 into ``out``."""
    _gather_into(out, x, group=group)


class CommRecord:
    """What a rank's expert-parallel all-to-alls did, when asked (tests and benchmarks; off by
    default): ``events``, ``(tag, what)`` in issue order (``what``: ``"counts"``, ``"start"``,
    ``"wait"``, ``"grad.start"``, ``"grad.wait"``), and ``blocked_s``, the host seconds spent
    inside those calls by ``what`` (on gloo the time the all-to-alls were exposed, the waits for a
    slower peer included; on CUDA only the launches, as a wait there blocks the compute stream,
    not the host)."""

    def __init__(self):
        self.events: list = []
        self.blocked_s: dict = {}

    def timed(self, tag: str, what: str, fn):
        t0 = time.perf_counter()
        out = fn()
        self.blocked_s[what] = self.blocked_s.get(what, 0.0) + time.perf_counter() - t0
        self.events.append((tag, what))
        return out


def recorded(record, tag: str, what: str, fn):
    """``fn()``, timed and logged in ``record`` when there is one."""
    return fn() if record is None else record.timed(tag, what, fn)


class AllToAllInFlight:
    """One all-to-all of rows between :func:`all_to_all_start` and :func:`all_to_all_wait`, in the
    forward and (transposed) in the backward: ``send_splits[i]`` rows go to rank i,
    ``recv_splits[i]`` come from it."""

    def __init__(self, send_splits: list, recv_splits: list, group, record: CommRecord | None = None,
                 tag: str = ""):
        self.splits, self.group, self.record, self.tag = (send_splits, recv_splits), group, record, tag
        self.work = None    # the forward's, then the backward's, pending collective
        self.grad = None    # the backward's receive buffer

    def launch(self, out, x, recv: list, send: list, what: str) -> None:
        self.work = recorded(self.record, self.tag, what, lambda: dist.all_to_all_single(
            out, x.contiguous(), recv, send, group=self.group, async_op=True))

    def wait(self, what: str) -> None:
        work, self.work = self.work, None
        recorded(self.record, self.tag, what, work.wait)  # GPU: the current stream waits, the host does not


class _Start(torch.autograd.Function):
    """Forward: issue the all-to-all. Backward: wait for the gradient's all-to-all, which
    :class:`_Finish`'s backward issued; the autograd nodes between the two run meanwhile."""

    @staticmethod
    def forward(ctx, x, flight: AllToAllInFlight):
        ctx.flight = flight
        send, recv = flight.splits
        out = x.new_empty(sum(recv), *x.shape[1:])
        flight.launch(out, x, recv, send, "start")
        return out

    @staticmethod
    def backward(ctx, g):
        flight = ctx.flight
        flight.wait("grad.wait")
        grad, flight.grad = flight.grad, None
        return grad, None


class _Finish(torch.autograd.Function):
    """Forward: wait for the rows. Backward: issue the gradient's all-to-all (back along the same
    routes) and return at once."""

    @staticmethod
    def forward(ctx, rows, flight: AllToAllInFlight):
        ctx.flight = flight
        flight.wait("wait")
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, g):
        flight = ctx.flight
        send, recv = flight.splits
        flight.grad = g.new_empty(sum(send), *g.shape[1:])
        flight.launch(flight.grad, g, send, recv, "grad.start")
        return g, None  # a placeholder: _Start's backward returns the received gradient


def all_to_all_start(x: torch.Tensor, flight: AllToAllInFlight) -> torch.Tensor:
    """Issue the all-to-all of ``x``'s rows; the result must not be read before
    :func:`all_to_all_wait` (forward), and the gradient's all-to-all runs between the two nodes
    (backward)."""
    return _Start.apply(x, flight)


def all_to_all_wait(rows: torch.Tensor, flight: AllToAllInFlight) -> torch.Tensor:
    return _Finish.apply(rows, flight)


class _AllGather(torch.autograd.Function):
    """Concatenate equal-shaped tensors from every rank along dim 0; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        world = dist.get_world_size(group)
        out = x.new_empty(world * x.shape[0], *x.shape[1:])
        _gather_into(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        world = dist.get_world_size(ctx.group)
        out = g.new_empty(g.shape[0] // world, *g.shape[1:])
        _scatter_from(out, g.contiguous(), group=ctx.group)
        return out, None


class _ReduceScatter(torch.autograd.Function):
    """Sum over ranks, each keeping its slice of dim 0; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        world = dist.get_world_size(group)
        out = x.new_empty(x.shape[0] // world, *x.shape[1:])
        _scatter_from(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        return _AllGather.apply(g, ctx.group), None


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    return _AllGather.apply(x, group)


def reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceScatter.apply(x, group)
