"""``--overlap-moe-expert-parallel-comm``: a decoder block's expert-parallel all-to-alls hidden
behind the block's own compute, in the forward and in the backward.

The block's micro-batch is cut into two chunks of whole documents (A, B: at the document start
nearest the middle, host integers, no device read; attention never crosses a document and the
MoE is per token, so the chunks are independent). The block then runs its phases interleaved:

=====  ==========================================  ====================================
 step   forward                                    in flight meanwhile
=====  ==========================================  ====================================
 1      attention(A), route(A), dispatch(A) starts
 2      attention(B), route(B), dispatch(B) starts  A's dispatch
 3      shared expert(A)                            A's and B's dispatch
 4      wait(A), experts(A), combine(A) starts      B's dispatch
 5      wait(B), experts(B), combine(B) starts      A's combine
 6      shared expert(B)                            A's and B's combine
 7      wait(A), wait(B): output                    (what is left of them)
=====  ==========================================  ====================================

Backward replays it in reverse on its own: each all-to-all is two autograd nodes
(``core/distributed/collectives.py``), a start whose backward waits and a wait whose backward
issues the gradient's all-to-all, and autograd runs the ready node created last in the forward
first, so the other chunk's backward compute (its experts, shared expert, attention) runs
between the two. ``tests/unit/test_moe_overlap.py`` records that order rather than trusting it.

On CUDA the all-to-alls run on NCCL's stream and a wait makes only the compute stream wait for
it (no host sync beyond the split sizes' read, one per chunk). Kernels from the two streams
interleave only if the device has more than one hardware queue: leave
``CUDA_DEVICE_MAX_CONNECTIONS`` unset (or > 1); Megatron's tensor-parallel setting of 1 would
serialise them. On gloo the all-to-alls run on gloo's threads, so a CPU run overlaps too.

Every rank cuts two chunks whatever its documents (a micro-batch that is one document gives an
empty B, whose phases still exchange: other ranks' tokens may be routed to this rank's experts),
so every rank issues the same collectives in the same order. The numbers are the block's: the
routing statistics of the chunks are summed and the auxiliary loss formed once from the sums,
as ``--recompute-chunks`` does (``core/moe/router.py:router_stats``). The rest is the plain
schedule's arithmetic, under ``--bf16`` too: a weight both chunks use gets its gradient from one
GEMM over both chunks' tokens (``core/moe/joined_grads.py``), and on CPU a chunk's sdpa
attention comes from the whole micro-batch's pieces (``_part``).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.distributed.fsdp import FSDPModule

from core.distributed import fsdp_internals as fsdp
from core.moe.dispatch import AllToAllDispatcher
from core.moe.joined_grads import JoinedWeightGrads
from core.moe.layer import MoELayer
from core.moe.router import router_stats
from core.transformer.attention_backends import DocLayout, PartOf
from core.transformer.chunked import _slice, _sub_layout


def split_point(layout: DocLayout) -> int:
    """The token offset of the cut: the document start nearest ``T / 2`` (the first of two as
    near), or ``T`` when the micro-batch is one document (B empty). E.g. starts [0, 10, 30], T 48:
    30 (|30 - 24| < |10 - 24|)."""
    inner = [s for s in layout.starts if 0 < s < layout.total]
    return min(inner, key=lambda s: abs(2 * s - layout.total)) if inner else layout.total


def _chunks(layout: DocLayout) -> list:
    """``[(start, end, sub-layout or None)]`` of A and B, made once per micro-batch."""
    key = ("overlap_moe_chunks",)
    if key not in layout.cache:
        cut, T = split_point(layout), layout.total
        layout.cache[key] = [(a, b, _part(layout, a, b) if b > a else None) for a, b in ((0, cut), (cut, T))]
    return layout.cache[key]


def _part(layout: DocLayout, a: int, b: int) -> DocLayout:
    """The chunk's layout, marked as part of the micro-batch's (its CPU sdpa attention then
    equals the unchunked layer's bitwise, ``core/transformer/sdpa_blocks.py``)."""
    sub = _sub_layout(layout, a, b)
    sub.part_of = PartOf(layout, a)
    return sub


def overlaps(block) -> bool:
    """Whether the block's FFN is an MoE layer whose tokens travel by all-to-all."""
    ffn = getattr(block, "ffn", None)
    return isinstance(ffn, MoELayer) and isinstance(ffn.dispatcher, AllToAllDispatcher)


def overlapped_forward(block, x_TH, ropes: dict, layout: DocLayout, valid_T):
    """``(output [T, hidden], MoE statistics)`` of a :class:`~core.transformer.block.DecoderBlock`
    with an all-to-all MoE FFN, by the schedule above."""
    moe: MoELayer = block.ffn
    d = moe.dispatcher
    parts = _chunks(layout)
    xs = x_TH.split([b - a for a, b, _ in parts])
    res, normed, flights, stats = [], [], [], []
    # FSDP units inside the MoE layer (the fp32 router, the experts over expert-DP) run once per
    # chunk: gathered once for both in the forward; the experts' reduction is held in the backward
    inner = [m for m in (moe.router, moe.experts) if isinstance(m, FSDPModule)]
    experts = [moe.experts] if moe.experts in inner else []
    held: list = []  # the experts unit's gradient settings while it is held (backward)
    # a weight both chunks use gets its gradient from one GEMM over both (core/moe/joined_grads.py)
    join = JoinedWeightGrads(block) if torch.is_grad_enabled() and all(p[2] is not None for p in parts) else None
    joined = join.chunk if join is not None else (lambda recv=None: nullcontext())
    with fsdp.gathered_through_forward(inner):
        for name, (a, b, sub), x in zip("AB", parts, xs):  # steps 1-2
            if sub is not None:
                with joined():
                    h, y = block.attention_block(x, _slice(ropes, a, b), sub)
            else:  # an empty chunk: no attention, but its all-to-alls still run
                h, y = x, block.post_attention_layernorm(x)
            weights, chosen, s = moe.router(y, valid_T[a:b])
            flights.append(d.dispatch_start(y, weights, chosen, chunk=name))
            res.append(h)
            normed.append(y)
            stats.append(s)
        shared = [None, None]
        if moe.shared_expert is not None:  # step 3
            with joined():
                shared[0] = moe.shared_expert(normed[0])
        for k, f in enumerate(flights):  # steps 4-5
            release = (lambda y: _release(y, experts, held)) if experts and k == 0 else None
            with joined(f.recv_counts):
                d.combine_start(f, moe.experts, d.dispatch_wait(f), after=release)
    if moe.shared_expert is not None:  # step 6
        with joined():
            shared[1] = moe.shared_expert(normed[1])
    out = [h + moe.output(d.combine_wait(f), s) for h, f, s in zip(res, flights, shared)]  # step 7
    counts, prob_sum, n = (stats[0][k] + stats[1][k] for k in ("tokens_per_expert", "prob_sum", "valid_tokens"))
    y = torch.cat(out)
    # held only where A's experts output needs a gradient (else no release would run in the backward)
    return _Hold.apply(y, experts, held, True) if held else y, router_stats(counts, prob_sum, n, moe.router.top_k)


def _release(y: torch.Tensor, units: list, held: list) -> torch.Tensor:
    """A's experts output, through the node that releases the held units in the backward, and
    ``held`` marked as to be filled by the hold (only if that node will run: ``y`` needs a
    gradient)."""
    if not y.requires_grad:
        return y
    held.append(None)  # the hold's backward replaces it with the units' settings
    return _Hold.apply(y, units, held, False)


class _Hold(torch.autograd.Function):
    """Identity whose backward holds (``hold``) or releases an FSDP unit's gradient reduction and
    reshard. The experts unit runs twice (A, then B); FSDP would reduce-scatter and reshard after
    each run's backward (B's first) and all-gather again for A's. Held from the block's output
    (the first node of its backward) to A's experts output (after B's experts backward, before
    A's), the unit gathers once and reduces once, B's gradient waiting in FSDP's accumulator (as
    ``--recompute-chunks`` holds its chunks'). The router is not held (its outputs reach the
    backward by several paths, so no node is sure to run between its two runs' backwards): it
    gathers once more per backward, ``E x hidden`` fp32."""

    @staticmethod
    def forward(ctx, y, units: list, held: list, hold: bool):
        ctx.units, ctx.held, ctx.hold = units, held, hold
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        if ctx.hold:
            ctx.held[:] = [fsdp.gradient_settings(u) for u in ctx.units]
            settings = [(False, False)] * len(ctx.units)
        else:
            settings = ctx.held
        for u, (reduce, reshard) in zip(ctx.units, settings):
            u.set_requires_gradient_sync(reduce, recurse=False)
            u.set_reshard_after_backward(reshard, recurse=False)
        return g, None, None, None


def check_overlap(ep: int, cp: int, dispatcher: str, recompute: str, compile: bool) -> None:
    """What ``--overlap-moe-expert-parallel-comm`` serves; ``ValueError`` naming the flag pair
    for what it refuses."""
    flag = "--overlap-moe-expert-parallel-comm"
    if ep == 1:
        raise ValueError(f"{flag} needs --expert-model-parallel-size > 1: with every expert local there is no "
                         "all-to-all to hide")
    if dispatcher != "alltoall":
        raise ValueError(f"{flag} needs --moe-dispatcher alltoall (the all-gather dispatcher has no phases)")
    for what, on in (("--context-parallel-size > 1", cp > 1), ("--compile", compile),
                     ("--recompute-granularity selective", recompute == "selective")):
        if on:
            raise ValueError(f"{flag} with {what} is not supported (not built yet): drop one of the two")


def apply_moe_overlap(chunk: torch.nn.Module) -> int:
    """Run the chunk's all-to-all MoE blocks by the overlapped schedule (after expert
    parallelism is applied); returns how many blocks do."""
    from core.transformer.block import DecoderBlock

    blocks = [m for m in chunk.modules() if isinstance(m, DecoderBlock) and overlaps(m)]
    for m in blocks:
        m.overlap_moe = True
    return len(blocks)
