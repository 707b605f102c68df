"""Differentiable collectives over an explicit process group (autograd runs the transpose)."""
from __future__ import annotations

import torch
import torch.distributed as dist

# torch renamed these; use whichever this version has
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_scatter_from = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """Non-differentiable all-gather along dim 0 into ``out``."""
    _gather_into(out, x, group=group)


class _AllToAll(torch.autograd.Function):
    """Uneven all-to-all of rows: ``send_splits[i]`` rows go to rank i, ``recv_splits[i]`` come
    from it. Backward sends gradients back along the same routes."""

    @staticmethod
    def forward(ctx, x, send_splits: list, recv_splits: list, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = x.new_empty(sum(recv_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        send_splits, recv_splits = ctx.splits
        out = g.new_empty(sum(send_splits), *g.shape[1:])
        dist.all_to_all_single(out, g.contiguous(), send_splits, recv_splits, group=ctx.group)
        return out, None, None, None


def all_to_all(x: torch.Tensor, send_splits: list, recv_splits: list, group) -> torch.Tensor:
    return _AllToAll.apply(x, send_splits, recv_splits, group)


class _AllToAllStart(_AllToAll):
    """The forward all-to-all issued asynchronously: the output is not ready until
    ``all_to_all_wait`` (autograd sees start -> wait; backward is the plain transpose)."""

    @staticmethod
    def forward(ctx, x, send_splits: list, recv_splits: list, group, pending: list):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = x.new_empty(sum(recv_splits), *x.shape[1:])
        pending.append(dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group,
                                              async_op=True))
        return out

    @staticmethod
    def backward(ctx, g):
        return _AllToAll.backward(ctx, g) + (None,)


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pending: list):
        pending.pop().wait()  # on GPU: the compute stream waits for NCCL's, the host does not
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


def all_to_all_overlapped(x: torch.Tensor, send_splits: list, recv_splits: list, group, work):
    """``all_to_all`` with ``work()`` (any differentiable computation that does not need the
    result, e.g. a shared expert) running while the rows are in flight; returns
    ``(rows, work())``."""
    pending: list = []
    started = _AllToAllStart.apply(x, send_splits, recv_splits, group, pending)
    side = work()
    return _Wait.apply(started, pending), side


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
