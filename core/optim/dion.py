"""Dion: orthonormalised low-rank updates by one warm-started power iteration, with error
feedback (Ahn et al., 2025). Single-process form; sharded matrices arrive with FSDP.

For a matrix ``X`` (m x n) with gradient ``G``, rank ``r = ceil(rank_fraction * min(m, n))``::

    B = M + G                       # M: momentum / error-feedback buffer (m x n)
    P = orthonormalise(B Q)         # Q: right factor from the last step (n x r), QR
    R = B^T P
    M = B - (1 - mu) P R^T          # what the low-rank step did not take stays in M
    Q = R / ||columns of R||
    X -= lr * sqrt(m / n) * P Q^T   (and decoupled weight decay)

At full rank with ``mu = 0`` the buffer is emptied every step and, once the warm-started power
iteration has converged (a few steps on a steady gradient), ``P Q^T`` is the orthogonal polar
factor ``U V^T`` of the gradient: the update Muon approximates with Newton-Schulz.
3-D expert stacks are treated as batches of matrices.
"""
from __future__ import annotations

import math

import torch
from torch.optim import Optimizer

from core.distributed.grads import local


class Dion(Optimizer):
    def __init__(self, params, lr: float = 0.01, momentum: float = 0.95, rank_fraction: float = 1.0,
                 weight_decay: float = 0.1, eps: float = 1e-8, seed: int = 0):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"--dion-momentum must be in [0, 1), got {momentum}")
        if not 0.0 < rank_fraction <= 1.0:
            raise ValueError(f"--dion-rank-fraction must be in (0, 1], got {rank_fraction}")
        super().__init__(params, dict(lr=lr, momentum=momentum, rank_fraction=rank_fraction,
                                      weight_decay=weight_decay, eps=eps))
        self.seed = seed

    def _init_state(self, p, group):
        m, n = p.shape[-2], p.shape[-1]
        r = max(1, math.ceil(group["rank_fraction"] * min(m, n)))
        g = torch.Generator().manual_seed(self.seed + p.numel())
        q = torch.randn(*p.shape[:-2], n, r, generator=g).to(p)
        return {"momentum": torch.zeros_like(p), "Q": q / q.norm(dim=-2, keepdim=True)}

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                # a DTensor on a one-rank mesh (bf16 without sharding) is whole here: work on
                # plain tensors, also for state a checkpoint load allocated like the parameter
                p, grad = local(p), local(p.grad)
                if not state:
                    state.update(self._init_state(p, group))
                for key, value in state.items():
                    state[key] = local(value)
                b = state["momentum"].add_(grad)
                P, _ = torch.linalg.qr(b @ state["Q"])
                R = b.mT @ P
                b.sub_((1 - group["momentum"]) * (P @ R.mT))
                state["Q"] = R / R.norm(dim=-2, keepdim=True).clamp(min=group["eps"])
                m, n = p.shape[-2], p.shape[-1]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.sub_(group["lr"] * math.sqrt(m / n) * (P @ state["Q"].mT))
        return loss
