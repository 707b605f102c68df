"""``--optimizer-in-backward``: Muon's matrices step inside the backward, each as soon as its
gradient is final, and that gradient is freed at once, so no whole-model gradient buffer exists.

When a rank runs one micro-batch per step, a parameter's gradient is final when its backward
has produced it: FSDP calls the parameter's post-accumulate-grad hooks right after it reduce-
scatters a unit's gradients (so a sharded matrix steps on its reduced shard, and its fp32 remainder
master is joined, updated and split back), and autograd calls them for a parameter FSDP does not
manage (under ``--recompute-chunks`` only after the block's last chunk: until then the
parameter is in ``pending``, ``core/transformer/chunked.PendingGrads``). The hook orthogonalises
the matrix (``Muon.update``), adds the gradient's square norm to the step's (on the device), and
drops the gradient.

Why clipping does not wait for it: with momentum 0, Muon's update of a gradient ``g`` is
``NS(g / |g|)``, the same for ``c * g`` with any ``c > 0`` up to rounding, so a global clip factor
known only after the backward could not change it. The AdamW groups (embeddings, norms, heads,
routers) keep their gradients to the end of the backward and step after the global norm and the
clip, as without this flag. Momentum > 0 with clipping would need the factor first: refused.

Where the work runs (CUDA): on a stream of its own, after the work queued so far on the stream
the hook is called on (autograd's for a parameter FSDP does not manage, FSDP's reduce-scatter
stream for one it does), so Newton-Schulz is not in the backward's queue: its kernels fill the
time the compute stream waits for an all-to-all (``training/planner/timing.hidden_newton_schulz``
counts only the waits that come after the work is queued). A row-sharded batch's two
all-to-alls go over FSDP's own data-parallel communicator, which runs its operations in issue
order: FSDP's next reduce-scatter and all-gather wait for that batch's Newton-Schulz (as they
did on the reduce-scatter stream; every rank issues them in the same order, so nothing
deadlocks). The gradient is kept from reuse until that stream is done with it
(``record_stream``), so about two blocks' gradients are alive (``training/planner/memory.py``
books them); ``end()`` makes the compute stream wait for it before anything reads a stepped
weight or the step's norm. Without CUDA the same code runs in order.

Non-finite values never reach the host: a matrix whose update is not finite (a NaN or inf in its
gradient spreads through Newton-Schulz to the whole matrix, on every rank that holds rows of it)
keeps its value, and the count of such matrices is a device tensor read with the step's metrics.
A non-finite loss is made a NaN gradient before the backward (``PipelineExecutor``), so every
matrix keeps its value and the step is skipped as usual.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from core.distributed.grads import local, owns, square_norm
from core.optim.muon_split import closes_batch, splittable
from core.parallel_state import ParallelState, local_device
from core.transformer.chunked import PendingGrads


class InBackwardSteps:
    """The hooks on one Muon optimizer's matrices; ``begin()`` before each step's backward.
    ``pending``: the parameters whose gradient a chunked block still accumulates
    (``core.transformer.block.pending_grads(chunks)``; None without ``--recompute-chunks``)."""

    def __init__(self, muon, specs: list, ps: ParallelState, pending: PendingGrads | None = None):
        device = local_device()
        self.muon = muon
        self.pending = pending if pending is not None else PendingGrads()
        self.sq = torch.zeros((), dtype=torch.float64, device=device)        # their gradients' square norm
        self.nonfinite = torch.zeros((), dtype=torch.int64, device=device)   # matrices left unchanged
        spec_of = {id(p): spec for p, spec in specs}
        self.params = []
        self._hooks = {}  # id(parameter) -> its hook (step_unreached calls it)
        for group in muon.param_groups:
            for p in group["params"]:
                counted = owns(p, spec_of[id(p)], ps)
                self._hooks[id(p)] = self._hook(group, counted)
                p.register_post_accumulate_grad_hook(self._hooks[id(p)])
                self.params.append(p)

        self.active = True
        self.held: dict = {}  # mesh -> [(matrix, group)] waiting for their batch (muon_split)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # the steps' own

    def begin(self, active: bool = True) -> None:
        """Before a step's backward; ``active=False`` (a step with no targets, to be skipped):
        the gradients stay for the step to discard."""
        self.sq.zero_()
        self.nonfinite.zero_()
        self.active = active
        self.held = {}

    def step_unreached(self, params: list) -> None:
        """After a backward that did not reach ``params`` (a vision tower skipped on every rank of
        its group: ``core/train_step.py``): those of them that step here step on a zero gradient,
        in the order given (the order the backward would have made their gradients final), as
        they would have after an idle pass; weight decay still applies to them."""
        for p in params:
            hook = self._hooks.get(id(p))
            if hook is not None and p.grad is None:
                p.grad = torch.zeros_like(p)
                hook(p)

    def _hook(self, group: dict, counted: bool):
        def step(p) -> None:
            if p.grad is None or not self.active or p in self.pending:
                return  # pending: a chunked block's gradient still accumulates (core/transformer/chunked.py)
            with torch.no_grad(), self._own_stream(p.grad):
                if counted:
                    g = local(p.grad)
                    self.sq.add_(square_norm(g).to(self.sq.device))  # no fp64 copy of the matrix
                if self.muon.split and splittable(p):  # one owner orthogonalises it: wait for a batch
                    self._hold(p, group)
                    return
                self._stepped(p, self.muon.update(p, group, guard=True))
        return step

    @contextmanager
    def _own_stream(self, grad=None):
        """Run on the steps' stream, after what the calling stream has queued (``grad`` was
        made there: it is not reused before this stream is done with it)."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        if grad is not None:
            local(grad).record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            yield

    def _stepped(self, p, kept) -> None:
        self.nonfinite.add_((~kept).to(self.nonfinite.device, torch.int64))
        p.grad = None

    def _hold(self, p, group: dict) -> None:
        """Row-sharded matrices wait until a batch of them can be dealt out evenly over their mesh:
        their Newton-Schulz FLOPs reach D times the largest one's (each rank then owns about as
        much as the largest matrix), or ``end()`` flushes the rest. Every rank of the mesh sees the
        same hooks in the same order, so the batches, and their all-to-alls, agree."""
        key = id(p.device_mesh.get_group())
        batch = self.held.setdefault(key, [])
        batch.append((p, group))
        if closes_batch([tuple(q.shape) for q, _ in batch], p.device_mesh.size()):
            self._flush(key)

    def _flush(self, key) -> None:
        batch = self.held.pop(key, [])
        for group in {id(g): g for _, g in batch}.values():
            params = [q for q, g in batch if g is group]
            for q, kept in zip(params, self.muon.update_many(params, group, guard=True)):
                self._stepped(q, kept)

    def end(self) -> None:
        """After the step's backward: the matrices still held step now (same order on every rank),
        and the compute stream waits for every step before it reads a weight or the norm."""
        with self._own_stream() if self.held else nullcontext():
            for key in list(self.held):
                self._flush(key)
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
