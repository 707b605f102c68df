"""The MoE feed-forward: ``scaling * routed(x) (+ shared_expert(x))``, and its routing statistics.

The statistics (tokens per expert over non-padding tokens, the router's auxiliary terms) are
returned with the output rather than kept on the module, so a caller sums them over every
micro-batch of a step, and activation recompute (which runs the forward again during backward)
cannot count a micro-batch twice."""
from __future__ import annotations

import torch
from torch import nn

from core.moe.dispatch import LocalDispatcher
from core.moe.experts import GroupedExperts
from core.moe.router import TopKRouter
from core.transformer.mlp import SwiGLUMLP


class MoELayer(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, expert_size: int,
                 shared_size: int = 0, *, scaling: float = 1.0, limit: float | None = None,
                 shared_limit: float | None = None, experts: range | None = None,
                 score: str = "sigmoid", correction_bias: bool = True, renormalize: bool = True,
                 groups: int = 1, topk_groups: int = 1):
        """``shared_size`` 0: no shared expert (several shared experts are one of their summed
        size); ``score`` / ``correction_bias`` / ``renormalize`` / ``groups`` / ``topk_groups``:
        the router's form (:class:`TopKRouter`); ``scaling``: the routed sum's factor
        (``routed_scaling_factor``)."""
        super().__init__()
        held = experts if experts is not None else range(num_experts)  # expert parallelism: a slice
        self.router = TopKRouter(hidden, num_experts, top_k, score=score, correction_bias=correction_bias,
                                 renormalize=renormalize, groups=groups, topk_groups=topk_groups)
        self.experts = GroupedExperts(len(held), hidden, expert_size, limit, expert_offset=held.start)
        self.shared_expert = SwiGLUMLP(hidden, shared_size, shared_limit) if shared_size else None
        self.scaling = scaling
        self.dispatcher = LocalDispatcher()  # replaced by parallelize for expert parallelism

    def forward(self, x_TH: torch.Tensor, valid_T: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """``(output [T, hidden], stats)``; ``stats``: see :meth:`TopKRouter.forward`."""
        weights, experts, stats = self.router(x_TH, valid_T)
        # the shared expert needs no routing: it runs while the dispatch all-to-all is in flight
        side = (lambda: self.shared_expert(x_TH)) if self.shared_expert is not None else (lambda: None)
        routed, shared = self.dispatcher(x_TH, weights, experts, self.experts, side=side)
        return self.output(routed, shared), stats

    def output(self, routed_TH: torch.Tensor, shared_TH: torch.Tensor | None) -> torch.Tensor:
        """The layer's output from the routed sum and the shared expert's (None without one);
        the phased schedule (``core/moe/overlap.py``) ends each chunk here."""
        if self.scaling != 1.0:
            routed_TH = routed_TH * self.scaling
        return routed_TH if shared_TH is None else routed_TH + shared_TH
