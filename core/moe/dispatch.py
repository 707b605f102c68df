"""Token dispatch: routed tokens -> rows grouped by expert -> back, weighted.

``permute``/``unpermute`` are pure local functions; a dispatcher adds communication around them
(the expert-parallel all-to-all arrives with the parallelism work). ``LocalDispatcher`` is the
single-process one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PermuteState:
    order: torch.Tensor       # [T*K] index into the flattened (token, k) slots, sorted by expert
    num_tokens: int


def permute(x_TH: torch.Tensor, experts_TK: torch.Tensor, num_experts: int):
    """Copies of each token, one per chosen expert, sorted by expert (stable)."""
    flat = experts_TK.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    x_NH = x_TH.index_select(0, order // experts_TK.shape[1])
    return x_NH, counts, PermuteState(order, x_TH.shape[0])


def unpermute(y_NH: torch.Tensor, weights_TK: torch.Tensor, state: PermuteState) -> torch.Tensor:
    """Weighted sum over each token's experts: ``sum_k w[t, k] * y[slot(t, k)]``."""
    K = weights_TK.shape[1]
    w = weights_TK.flatten().index_select(0, state.order)
    out = y_NH.new_zeros(state.num_tokens, y_NH.shape[1])
    # weight in fp32 (the router's precision), then accumulate in the activation dtype
    return out.index_add(0, state.order // K, (y_NH * w[:, None]).to(y_NH.dtype))


class LocalDispatcher:
    """All experts live in this process."""

    def __call__(self, x_TH, weights_TK, experts_TK, experts_module) -> torch.Tensor:
        x_NH, counts, state = permute(x_TH, experts_TK, experts_module.num_experts)
        return unpermute(experts_module(x_NH, counts), weights_TK, state)
