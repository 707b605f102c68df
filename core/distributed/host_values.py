"""The few places where the host reads tensor values (each a device sync on a GPU): split sizes
of the expert dispatch, per-expert row counts of the experts' loop, and the step's metrics. They
read through here so that a traced step (``training/trace/``: fake tensors, which have shapes
but no values) gets the values the planner assumes instead: routing balanced over the entries,
metrics zero. A real run reads the tensor; there is no other path."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake


def host_counts(counts: torch.Tensor, total: int) -> list[int]:
    """``counts.tolist()``; traced: ``total`` rows split evenly over the entries (balanced
    routing, the remainder to the first ones)."""
    if not is_fake(counts):
        return counts.tolist()
    n = counts.numel()
    base, extra = divmod(int(total), max(n, 1))
    flat = [base + (i < extra) for i in range(n)]
    return flat if counts.dim() <= 1 else [flat[i:i + counts.shape[-1]] for i in range(0, n, counts.shape[-1])]


def host_values(t: torch.Tensor, assumed: list | None = None) -> list[float]:
    """``t.tolist()`` of a 1-D tensor; traced: ``assumed``, else zeros (metrics: a trace has no
    values)."""
    if not is_fake(t):
        return t.tolist()
    return list(assumed) if assumed is not None else [0.0] * t.numel()
