"""Weight gradients of a two-chunk block computed once over both chunks' tokens (the overlap's,
``core/moe/overlap.py``), so that they are the plain schedule's arithmetic.

A weight that both chunks use (attention projections and norms, the shared expert, the routed
experts) would get two gradients, one per chunk, summed: under ``--bf16`` two rounded GEMM
results and one rounding more than the plain schedule's single GEMM over all tokens (and the
chunks' fp32 norm reductions rounded twice). Here each use runs through :class:`_Deferred`: its
backward computes only the input gradient at once and keeps ``(input, output gradient)``; the
use whose backward comes last (autograd runs B's before A's, but any order serves) computes the
weight gradient as ONE reduction over the uses' tokens in forward order, ``[A; B]``: the plain
schedule's GEMM (or sum) on the same data in the same order, bitwise on CPU, and the only
gradient autograd accumulates (the other use returns none). It arrives inside the block's
backward, so before FSDP's post-backward reduce of the weight's unit (the experts unit is held
until A's experts backward, core/moe/overlap.py), and the all-to-alls stay overlapped: nothing
waits for the joined GEMM but the weight's own gradient. Cost: the first chunk's output
gradient of each such op is kept until the second's arrives (one chunk's activations' worth,
in the block's backward), and one concatenation of each operand.

The routed experts take rows grouped by expert, then source rank (``sort_by_local_expert``);
the plain schedule's rows of expert ``e`` from source ``s`` are A's tokens then B's, so the
joined rows are put in (expert, source, chunk) order first. LoRA's adapters are joined on their
bf16 casts (the gradient then cast to the fp32 adapter once, as in the plain schedule); their
frozen base weights need none. Not joined: the fp32 router (two fp32 GEMMs differ from one by
fp32 rounding only) and any linear whose input is not 2-D.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from core.finetune.lora import LoRAGroupedExperts, LoRALinear
from core.moe.dispatch import sort_by_local_expert
from core.moe.experts import _GROUPED_MM, GroupedExperts, expert_linear
from core.transformer.norm import RMSNorm


class _Uses:
    """What the backward of each use of one weight kept, in forward order (None: not yet run);
    :meth:`arrive` hands them all to the last use to arrive."""

    def __init__(self):
        self.kept: list = []

    def add(self) -> int:
        self.kept.append(None)
        return len(self.kept) - 1

    def arrive(self, i: int, saved: tuple) -> list | None:
        self.kept[i] = saved
        if any(s is None for s in self.kept):
            return None
        parts, self.kept = self.kept, []
        return parts


class _Deferred(torch.autograd.Function):
    """``op.forward(x, *weights)``; backward: ``op.dgrad`` now, ``op.wgrad`` over every use's
    ``(x, g)`` once the last use's arrives (None before)."""

    @staticmethod
    def forward(ctx, op, uses: _Uses, i: int, extra, x, *weights):
        ctx.op, ctx.uses, ctx.i, ctx.extra = op, uses, i, extra
        ctx.save_for_backward(x, *weights)
        return op.forward(x, *weights)

    @staticmethod
    def backward(ctx, g):
        x, *weights = ctx.saved_tensors
        dx = ctx.op.dgrad(g, x, *weights) if ctx.needs_input_grad[4] else None
        parts = ctx.uses.arrive(ctx.i, (x, g, ctx.extra))
        grads = ctx.op.wgrad(parts, *weights) if parts is not None else (None,) * len(weights)
        return (None, None, None, None, dx, *grads)


class _Linear:
    """``F.linear`` of a 2-D input; the gradients autograd's ``addmm`` / ``mm`` give
    (``mm_mat1_backward``, ``mm_mat2_backward`` for a row-major weight, bias: ``g.sum(0)``)."""

    @staticmethod
    def forward(x, w, b=None):
        return F.linear(x, w, b)

    @staticmethod
    def dgrad(g, x, w, b=None):
        return g.mm(w)

    @staticmethod
    def wgrad(parts, w, b=None):
        x, g = (torch.cat(t) for t in zip(*((x, g) for x, g, _ in parts)))
        return (g.t().mm(x),) if b is None else (g.t().mm(x), g.sum(0))


class _NormScale:
    """RMSNorm's weight applied to its normalised fp32 input ``y`` (:meth:`RMSNorm.scale`); the
    weight's gradient is autograd's ``sum_to(grad * y)`` over the leading dims (fp32 for the
    ``1 + w`` form, then cast to the weight's dtype; the weight's dtype for ``w * y``)."""

    def __init__(self, norm: RMSNorm, dtype):
        self.offset, self.dtype = norm.offset, dtype

    def forward(self, y, w):
        return RMSNorm.scale(y, w, self.offset, self.dtype)

    def dgrad(self, g, y, w):
        if self.offset:
            return g.float() * (1.0 + w.float())
        return (g * w).float()

    def wgrad(self, parts, w):
        y, g = (torch.cat(t) for t in zip(*((y, g) for y, g, _ in parts)))
        if self.offset:
            return ((g.float() * y).sum(tuple(range(y.dim() - 1))).to(w.dtype),)
        return ((g * y.to(self.dtype)).sum(tuple(range(y.dim() - 1))),)


class _ExpertProjection:
    """One projection of the routed experts (rows grouped by local expert, then source rank;
    ``extra``: the chunk's ``recv_counts [source, expert]`` and the loop's segment sizes): the
    gradients of ``expert_linear``'s grouped GEMM (``grouped_mm``'s own backward:
    ``grouped_mm(g, w)``, ``grouped_mm(g^T, x)``) or of its per-expert loop, the weight's over
    both chunks' rows in the plain schedule's order."""

    def __init__(self, counts, grouped: bool, sizes):
        self.counts, self.grouped, self.sizes = counts, grouped, sizes

    def forward(self, x, w):
        return expert_linear(x, w, self.counts, self.grouped, self.sizes)

    def dgrad(self, g, x, w):
        w, g = w.to(x.device), g.contiguous()
        if self.grouped:
            return _GROUPED_MM(g, w, offs=torch.cumsum(self.counts, 0).to(torch.int32))
        return torch.cat([gs.mm(w[e]) for e, gs in enumerate(g.split(self.sizes))])

    def wgrad(self, parts, w):
        # each part's rows: (local expert, source); the plain schedule's: (expert, source, chunk)
        blocks = torch.stack([recv.T.flatten() for _, _, (recv, _) in parts])  # [chunk, (expert, source)]
        order, _ = sort_by_local_expert(blocks, sum(x.shape[0] for x, _, _ in parts))
        x, g = (torch.cat(t).index_select(0, order) for t in zip(*((x, g.contiguous()) for x, g, _ in parts)))
        if self.grouped:
            counts = sum(recv.sum(0) for _, _, (recv, _) in parts)
            dw = _GROUPED_MM(g.transpose(0, 1), x, offs=torch.cumsum(counts, 0).to(torch.int32))
        else:  # the chunks' segment sizes, host ints already read
            sizes = [sum(n) for n in zip(*(s for _, _, (_, s) in parts))]
            dw = torch.stack([gs.t().mm(xs) for gs, xs in zip(g.split(sizes), x.split(sizes))])
        return (dw.to(w.device),)


def _joinable(m: nn.Module):
    """Which of a module's methods runs joined (None: the module is left as it is): plain
    linears, RMSNorms and routed experts with a trainable weight, and LoRA's adapters (a LoRA
    module's ``adapter``: its base weight is frozen)."""
    if isinstance(m, (LoRALinear, LoRAGroupedExperts)):
        return "adapter"
    if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward and m.weight.requires_grad:
        return "forward"
    if isinstance(m, RMSNorm) and type(m).forward is RMSNorm.forward and m.weight.requires_grad:
        return "forward"
    if isinstance(m, GroupedExperts) and type(m).project is GroupedExperts.project and m.gate_proj.requires_grad:
        return "project"
    return None


class JoinedWeightGrads:
    """One block forward's joined weights: :meth:`chunk` runs a chunk's part of the forward with
    the block's plain linears, RMSNorms, routed experts and LoRA adapters deferring their weight
    gradients."""

    def __init__(self, block: nn.Module):
        self.modules = [(m, name) for m in block.modules() if (name := _joinable(m)) is not None]
        self.uses: dict[int, _Uses] = {}

    def _deferred(self, op, weights: tuple, x, extra=None, key=None):
        """``op`` on ``x`` and ``weights``, its uses counted under ``key`` (the parameter, when
        ``weights[0]`` is its cast: a LoRA adapter's)."""
        uses = self.uses.setdefault(id(weights[0] if key is None else key), _Uses())
        return _Deferred.apply(op, uses, uses.add(), extra, x, *weights)

    def _linear(self, m: nn.Linear, x):
        if x.dim() != 2:
            return nn.Linear.forward(m, x)
        return self._deferred(_Linear, (m.weight,) if m.bias is None else (m.weight, m.bias), x)

    def _norm(self, m: RMSNorm, x):
        return self._deferred(_NormScale(m, x.dtype), (m.weight,), m.normalize(x))

    def _project(self, m: GroupedExperts, recv_counts, name, x, counts, segments):
        grouped, sizes = segments
        return self._deferred(_ExpertProjection(counts, grouped, sizes), (getattr(m, name),), x, (recv_counts, sizes))

    def _adapter(self, recv_counts, w, x, *expert_args):
        """A LoRA adapter's linear (``expert_args``: the grouped adapters' counts, grouped,
        sizes), on the adapter cast to the input's dtype, counted under the fp32 adapter."""
        if expert_args:
            counts, grouped, sizes = expert_args
            return self._deferred(_ExpertProjection(counts, grouped, sizes), (w.to(x.dtype),), x,
                                  (recv_counts, sizes), key=w)
        if x.dim() != 2:
            return F.linear(x, w.to(x.dtype))
        return self._deferred(_Linear, (w.to(x.dtype),), x, key=w)

    def _joined(self, m: nn.Module, name: str, recv_counts):
        """The method ``name`` of ``m`` (``_joinable``'s) as this chunk runs it."""
        if name == "adapter":
            return lambda *a: self._adapter(recv_counts, *a)
        if name == "project":
            return lambda *a: self._project(m, recv_counts, *a)
        if isinstance(m, RMSNorm):
            return lambda x: self._norm(m, x)
        return lambda x: self._linear(m, x)

    @contextmanager
    def chunk(self, recv_counts: torch.Tensor | None = None):
        """Inside: this chunk's uses are deferred (``recv_counts``: the chunk's ``[source, local
        expert]`` row counts, where its experts run). A checkpoint inside (selective recompute,
        which the overlap refuses) would rerun its part outside, and torch's checkpoint raises
        on the other saved tensors; full recompute reruns the whole block, so its rerun is in
        here again."""
        with ExitStack() as undo:
            for m, name in self.modules:
                setattr(m, name, self._joined(m, name, recv_counts))
                undo.callback(delattr, m, name)
            yield
