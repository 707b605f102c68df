"""What an asynchronous collective keeps alive while it is in flight, as on the GPU.

ProcessGroupNCCL stashes an async op's input and output tensors in its ``Work``
(``stashed_for_allocator_safety_``: torch stashes them for every ``async_op=True`` collective)
and releases them in ``wait()``, once the caller's stream has been made to wait for NCCL's: the
caching allocator cannot hand a send buffer to other work while NCCL's stream still reads it,
even if the caller dropped it at once. The fake process group's ``Work`` holds nothing, so a
trace would count such a buffer freed at the start (the MoE dispatch's permuted tokens, dropped
when ``dispatch_start`` returns, are sent while the shared expert runs). While a trace runs,
:func:`held_until_wait` makes every async collective of ``torch.distributed`` return a
:class:`HeldWork` that keeps its tensors until ``wait()``, as NCCL's does; nothing in the model
changes."""
from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

# the collectives that take ``async_op`` (those missing from this torch are skipped)
ASYNC = ("all_to_all_single", "all_to_all", "all_gather_into_tensor", "all_gather_single", "all_gather",
         "reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter", "all_reduce", "broadcast")


class HeldWork:
    """A ``Work`` and the tensors its collective reads and writes, released by ``wait()``."""

    def __init__(self, work, tensors: list):
        self.work, self.tensors = work, tensors

    def wait(self, *args, **kwargs):
        out = self.work.wait(*args, **kwargs)
        self.tensors = []  # NCCL: unstashed once the caller's stream waits for the collective
        return out

    def __getattr__(self, name):
        return getattr(self.work, name)


def _holding(fn):
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        work = fn(*args, **kwargs)
        if work is None or not signature.bind(*args, **kwargs).arguments.get("async_op"):
            return work
        return HeldWork(work, [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)])
    return call


@contextlib.contextmanager
def held_until_wait():
    """Inside: ``torch.distributed``'s async collectives keep their tensors until ``wait()``
    (restored on exit)."""
    saved = {name: getattr(dist, name) for name in ASYNC if hasattr(dist, name)}
    try:
        for name, fn in saved.items():
            setattr(dist, name, _holding(fn))
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
