"""Our AdamW: torch.optim.AdamW's updates, with the parameters that are their own masters
stepped by one foreach call per group, so the dispatched ops of a step do not grow with the
number of parameters (about ten per parameter one at a time: thousands for a model's norms)."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from core.optim.adamw import AdamW


class _CountOps(TorchDispatchMode):
    """Ops on tensor data: what would each launch a kernel on a GPU (reading the host-side step
    counters, 0-d CPU tensors even on a GPU, is left out)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))  # a foreach op's lists too
        self.n += any(isinstance(t, torch.Tensor) and t.dim() > 0 for t in leaves)
        return func(*args, **(kwargs or {}))


def _params(n: int, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(3 + i % 4, 5, generator=g)) for i in range(n)]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)
    return ps


def _ops_of_a_step(n: int) -> int:
    ps = _params(n)
    opt = AdamW([{"params": ps, "weight_decay": 0.1}], lr=1e-2)
    opt.step()  # the state exists from here on
    with _CountOps() as c:
        opt.step()
    return c.n


def test_dispatched_ops_of_a_step_do_not_grow_with_the_parameters():
    few, many = _ops_of_a_step(8), _ops_of_a_step(64)
    assert many == few and few < 30, (few, many)  # one at a time: ~10 per parameter, 640 for 64


def test_updates_equal_torch_adamw():
    ours, theirs = _params(6, seed=1), _params(6, seed=1)
    a = AdamW([{"params": ours, "weight_decay": 0.1}, {"params": ours[:0], "weight_decay": 0.0}],
              lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    b = torch.optim.AdamW(theirs, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    for step in range(3):
        g = torch.Generator().manual_seed(10 + step)
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    # the same elementwise maths (foreach runs torch's per-tensor kernels on the CPU): bit for bit
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs))
