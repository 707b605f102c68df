"""Layer-wise gradient accumulation: a fully recomputed block run a token chunk at a time.

Under ``--recompute-granularity full`` a block keeps only its inputs and reruns its forward in the
backward. With ``--recompute-chunks N`` it runs that forward, and later the rerun and backward,
on N equal token chunks of the micro-batch one after another: groups of whole packs (N divides
``--micro-batch-size``), so attention never needs another chunk and every rank runs the same
N chunks (the all-to-alls of expert parallelism inside a block stay matched). The block's parameter gradients accumulate over its chunks before FSDP reduces them
(inner FSDP units, the experts and the fp32 router, skip their reduce-scatter and stay gathered
until the last chunk), so a micro-batch of N packs holds the backward's working set and the
all-to-all buffers of one pack, and only one block's gradients at a time: what micro-batching
would give, without a whole-model gradient buffer, so ``--optimizer-in-backward`` and
``--cpu-offload masters`` (one micro-batch per step) serve N packs per rank.

``--offload-recompute-inputs``: the kept inputs wait in (pinned) host memory between the forward
and the backward, copied out on a stream of their own (the compute stream never waits for it)
and back on the compute stream when the block's backward starts. That stream is one per device,
made once and shared by every block (:class:`ChunkedRecompute`, which ``parallelize`` makes once
per rank): a stream per block would draw 45 from torch's pool of 32 high-priority streams,
which FSDP2's copy-in, all-gather and reduce-scatter streams come from too, and so share theirs.

FSDP2's private API (a unit's parameter groups and training state) is reached through
``core/distributed/fsdp_internals.py``.

The arithmetic is the unchunked block's, chunk by chunk: token-wise maths and attention are
unchanged, gradients are sums over chunks in another order (fp32 rounding). The MoE statistics
of the chunks are summed and the auxiliary loss formed once from the sums
(:func:`core.moe.router.router_stats`), as the unchunked router forms it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule

from core.distributed import fsdp_internals as fsdp
from core.moe.layer import MoELayer
from core.moe.router import router_stats
from core.packed_seq import PackedSeqParams
from core.transformer.attention_backends import DocLayout


class PendingGrads:
    """The parameters whose gradient still accumulates over a chunked block's chunks (in fp32,
    beside autograd): hooks that take a gradient as final (``core/optim/in_backward.py``) ask
    ``p in pending`` and leave it alone until the block's last chunk."""

    def __init__(self):
        self._ids: set[int] = set()

    def set(self, p: torch.Tensor, pending: bool) -> None:
        (self._ids.add if pending else self._ids.discard)(id(p))

    def __contains__(self, p) -> bool:
        return id(p) in self._ids

    def __len__(self) -> int:
        return len(self._ids)


class ChunkedRecompute:
    """What a rank's chunked blocks share: ``pending`` (:class:`PendingGrads`, which the in-backward
    optimizer is given) and the offload copy stream of each device, made on first use and kept
    (CUDA only). ``parallelize`` makes one per rank and ``apply_recompute`` hands it to the blocks;
    without one each ``apply_recompute`` call makes its own."""

    def __init__(self):
        self.pending = PendingGrads()
        self._streams: dict[int, object] = {}  # device index -> torch.cuda.Stream
        # called with each input kept in host memory (--offload-recompute-inputs): the memory
        # trace (training/trace/), whose CPU stands in for the GPU, counts it as host memory
        self.host_observer = None

    def offload_stream(self, device: torch.device):
        """The device's copy stream: high priority (the copy-out is short and the compute stream's
        next kernels need not wait behind it), drawn once from torch's high-priority pool, so it is
        not one of FSDP2's streams (three per root, drawn at the root's first forward, before any
        block's) while the device has fewer than 32 such streams."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._streams:
            self._streams[index] = torch.cuda.Stream(torch.device("cuda", index), priority=-1)
        return self._streams[index]


@dataclass
class _Run:
    """What the autograd function needs besides the tensors."""

    fn: object            # fn(*tensor_chunks, chunk) -> (*outputs, stats or None)
    chunks: list          # the micro-batch's Chunk list
    units: list           # the block's inner FSDP units
    block: torch.nn.Module
    offload: bool
    stream: object        # the device's copy stream (CUDA with offload), else None
    pending: PendingGrads
    host_observer: object = None  # ChunkedRecompute.host_observer


@dataclass
class Chunk:
    start: int          # first token
    end: int            # one past the last token
    layout: DocLayout
    ropes: dict
    valid: torch.Tensor


def chunk_cuts(layout: DocLayout, n: int) -> list[int]:
    """Token offsets ``[0, T/n, 2T/n, ..., T]`` of the ``n`` chunks (host integers: no device
    read). Every rank cuts the same ``n`` chunks whatever its documents, so collectives inside a
    block (expert parallelism's all-to-alls) run as often on each; a cut must fall where a
    document ends, which holds for groups of whole packs (documents never cross a pack)."""
    T = layout.total
    bounds = set(layout.starts) | {T}
    cuts = [k * T // n for k in range(n + 1)]
    if T % n or not set(cuts) <= bounds:
        raise ValueError(f"--recompute-chunks {n}: a micro-batch of {T} tokens does not split into {n} equal "
                         "groups of whole documents (use a divisor of --micro-batch-size: chunks of whole packs)")
    return cuts


def _sub_layout(layout: DocLayout, start: int, end: int) -> DocLayout:
    """The documents in tokens ``[start, end)`` (whole documents) as a layout of their own; the
    device boundaries are sliced on the device."""
    p = layout.params
    cu, padded = p.host_boundaries()
    d0, d1 = padded.index(start), padded.index(end)
    host_cu = tuple(c - cu[d0] for c in cu[d0:d1 + 1])
    host_padded = tuple(c - start for c in padded[d0:d1 + 1])
    sub = PackedSeqParams(p.cu_seqlens[d0:d1 + 1] - p.cu_seqlens[d0], p.cu_seqlens_padded[d0:d1 + 1] - start,
                          max((b - a for a, b in zip(host_cu, host_cu[1:])), default=0), p.qkv_format,
                          host_cu, host_padded)
    return DocLayout.from_params(sub)


def _slice(obj, a: int, b: int):
    if isinstance(obj, torch.Tensor):
        return obj[a:b]
    if isinstance(obj, (tuple, list)):
        return type(obj)(_slice(o, a, b) for o in obj)
    if isinstance(obj, dict):
        return {k: _slice(v, a, b) for k, v in obj.items()}
    return obj


def make_chunks(layout: DocLayout, ropes: dict, valid: torch.Tensor, n: int) -> list[Chunk]:
    """The micro-batch's chunks (built once per forward and shared by its blocks)."""
    key = ("recompute_chunks", n)
    if key not in layout.cache:
        cuts = chunk_cuts(layout, n)
        layout.cache[key] = [(a, b, _sub_layout(layout, a, b)) for a, b in zip(cuts, cuts[1:])]
    return [Chunk(a, b, sub, _slice(ropes, a, b), valid[a:b]) for a, b, sub in layout.cache[key]]


class _Stash:
    """A kept input: on the device, or in host memory behind the event of its copy."""

    def __init__(self, t: torch.Tensor, offload: bool, stream, host_observer=None):
        self.device, self.event = t.device, None
        if not offload:
            self.t = t
            return
        if t.device.type != "cuda":  # the same path on CPU (tests): a copy
            self.t = torch.empty_like(t, device="cpu").copy_(t)
            if host_observer is not None:
                host_observer([self.t])
            return
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            self.t = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(stream)
        t.record_stream(stream)  # its memory is not reused before the copy has read it

    def get(self) -> torch.Tensor:
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
        return self.t.to(self.device, non_blocking=True)


def _inner_units(block: torch.nn.Module) -> list:
    return [m for m in block.modules() if m is not block and isinstance(m, FSDPModule)]


class _Chunked(torch.autograd.Function):
    """``apply(run, n_in, *inputs, anchor?)``: the block's parameters are used inside, not passed
    in, and a custom Function's outputs need a gradient only when one of its inputs does; a
    trailing ``anchor`` (:func:`_anchor`) stands in for them when no input does."""

    @staticmethod
    def forward(ctx, run: _Run, n_in, *tensors):
        fn, chunks = run.fn, run.chunks
        inputs, outs, stats = tensors[:n_in], [], []
        # the inner units stay gathered over the chunks: one all-gather, not one per chunk
        with fsdp.gathered_through_forward(run.units), torch.no_grad():
            for ch in chunks:
                *o, s = fn(*(t[ch.start:ch.end] for t in inputs), ch)
                outs.append(o)
                stats += [s] if s is not None else []
        ctx.run, ctx.n_out, ctx.has_stats = run, len(outs[0]), bool(stats)
        ctx.needs = [t.requires_grad for t in inputs]
        ctx.stash = [_Stash(t.detach(), run.offload, run.stream, run.host_observer) for t in inputs]
        cat = [torch.cat([o[i] for o in outs]) for i in range(ctx.n_out)]
        if not stats:
            return (*cat,)
        prob_sum, counts, valid = (sum(s[k] for s in stats) for k in ("prob_sum", "tokens_per_expert", "valid_tokens"))
        ctx.mark_non_differentiable(counts, valid)
        return (*cat, prob_sum, counts, valid)

    @staticmethod
    def backward(ctx, *grads):
        fn, chunks, units, block = ctx.run.fn, ctx.run.chunks, ctx.run.units, ctx.run.block
        inputs = [s.get() for s in ctx.stash]
        del ctx.stash
        grad_outs, grad_prob = grads[:ctx.n_out], grads[ctx.n_out] if ctx.has_stats else None
        grad_in = [torch.zeros_like(t) if need else None for t, need in zip(inputs, ctx.needs)]
        saved = [(u, *fsdp.gradient_settings(u)) for u in units]
        inner = {m for u in units for m in u.modules()}  # FSDP accumulates their parameters itself
        pending = ctx.run.pending
        acc, marked = {}, {}  # id -> fp32 sum of the earlier chunks; parameters marked pending
        try:
            for k, ch in enumerate(chunks):
                last = k == len(chunks) - 1
                for u, reduce, reshard in saved:  # reduce (and free) only after the last chunk
                    u.set_requires_gradient_sync(reduce and last, recurse=False)
                    u.set_reshard_after_backward(reshard and last, recurse=False)
                # FSDP runs a unit's hooks in its first rerun only: later ones see it in backward
                # already and skip them (as under hook-based checkpointing), so this runs its
                # post-backward (accumulate in fp32, or on the last chunk reduce) itself
                manual = [u for u in units if fsdp.in_backward(u)]
                for u in manual:
                    u.unshard()  # a no-op: kept gathered since its first chunk
                with torch.enable_grad():
                    ins = [t[ch.start:ch.end].detach().requires_grad_(need) for t, need in zip(inputs, ctx.needs)]
                    *outs, s = fn(*ins, ch)
                roots, seeds = [], []
                for o, g in zip(outs, grad_outs):
                    if g is not None and o.requires_grad:
                        roots.append(o)
                        seeds.append(g[ch.start:ch.end])
                if grad_prob is not None and s is not None and s["prob_sum"].requires_grad:
                    roots.append(s["prob_sum"])
                    seeds.append(grad_prob)
                # the parameters this chunk's backward accumulates into (FSDP's unsharded ones
                # while gathered), less the inner units' (by module: their own may be swapped)
                mine = {id(p) for m in block.modules() if m not in inner for p in m.parameters(recurse=False)}
                own = [p for p in _leaves(roots) if id(p) in mine]
                for p in own:
                    pending.set(p, not last)
                    marked[id(p)] = p
                if last:  # the earlier chunks' sum joins this chunk's gradient before autograd stores it
                    hooks = [p.register_hook(_adds(acc, id(p))) for p in own if id(p) in acc]
                else:  # each gradient joins the fp32 sum as soon as autograd stores it
                    hooks = [p.register_post_accumulate_grad_hook(_moves(acc)) for p in own]
                if roots:
                    torch.autograd.backward(roots, seeds)
                for h in hooks:
                    h.remove()
                for u in manual:
                    fsdp.post_backward(u)
                for g, t in zip(grad_in, ins):
                    if g is not None and t.grad is not None:
                        g[ch.start:ch.end] = t.grad
            if acc:  # hooks that take a gradient as final (the in-backward step) would never see it
                names = {id(p): n for n, p in block.named_parameters()}
                raise RuntimeError("--recompute-chunks: parameters with a gradient in an earlier chunk but none in "
                                   f"the last: {sorted(names.get(k, '?') for k in acc)}; every chunk of a "
                                   "block must reach all of its parameters")
        finally:
            for u, reduce, reshard in saved:
                u.set_requires_gradient_sync(reduce, recurse=False)
                u.set_reshard_after_backward(reshard, recurse=False)
            for p in marked.values():
                pending.set(p, False)
        return (None, None, *grad_in, *[None] * (len(ctx.needs_input_grad) - 2 - len(grad_in)))


def _anchor(block: torch.nn.Module, tensors: tuple) -> tuple:
    """``(anchor,)`` when the block has a trainable parameter but none of its input tensors needs
    a gradient (the first block after a frozen embedding: LoRA, ``--freeze-language``), else
    ``()``. The anchor, an empty leaf that needs a gradient (and gets none), makes the outputs
    need one, so autograd reaches the backward that differentiates the parameters (as
    torch.utils.checkpoint's non-reentrant hooks keep the parameters in the graph); without it the
    loss needs no gradient and nothing in the block trains. Not the parameters themselves: under
    FSDP2 those are swapped between sharded and gathered tensors, and an edge to them would fire
    their accumulate-grad hooks (the in-backward step) with no gradient."""
    if not torch.is_grad_enabled() or any(t.requires_grad for t in tensors) or \
            not any(p.requires_grad for p in block.parameters()):
        return ()
    return (torch.empty(0, device=tensors[0].device, requires_grad=True),)


def _leaves(roots: list) -> list:
    """The leaf tensors requiring grad (parameters, and the chunk's detached inputs, which are
    not parameters of anything) that autograd would accumulate into from ``roots``."""
    seen, out, todo = set(), [], [r.grad_fn for r in roots if r.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if var is not None and isinstance(var, torch.nn.Parameter):
            out.append(var)
        todo.extend(nxt for nxt, _ in node.next_functions)
    return out


def _moves(acc: dict):
    """A post-accumulate hook for a chunk before the last: the stored gradient (with what earlier
    micro-batches left in it) joins the parameter's fp32 sum and is freed, so a chunk holds one
    parameter's compute-dtype gradient at a time beside the sums."""
    def move(p) -> None:
        prev = acc.get(id(p))
        acc[id(p)] = p.grad.float() if prev is None else prev.add_(p.grad)
        p.grad = None
    return move


def _adds(acc: dict, key: int):
    """A gradient hook for the last chunk: the earlier chunks' fp32 sum plus this one, rounded to
    the parameter's dtype once (as the unchunked block's single GEMM rounds it)."""
    return lambda g: acc.pop(key).add_(g).to(g.dtype)


def chunked_recompute(block: torch.nn.Module, fn, tensors: tuple, ropes: dict, layout: DocLayout, valid,
                      chunks: int, offload: bool, shared: ChunkedRecompute):
    """``fn(*tensor_chunks, ropes, layout, valid)`` returns ``(*outputs, MoE statistics or None)``
    for one chunk; this returns the same for the whole micro-batch (outputs concatenated,
    statistics summed), recomputing each chunk in the backward. ``block``: the FSDP unit whose
    inner units wait for the last chunk before they reduce, and whose MoE layer (at most one)
    makes the statistics; ``shared``: what the rank's chunked blocks share."""
    moe = [m for m in block.modules() if isinstance(m, MoELayer)]
    top_k = moe[0].router.top_k if moe else 0
    device = tensors[0].device
    stream = shared.offload_stream(device) if offload and device.type == "cuda" else None
    run = _Run(lambda *a: fn(*a[:-1], a[-1].ropes, a[-1].layout, a[-1].valid),
               make_chunks(layout, ropes, valid, chunks), _inner_units(block), block, offload, stream,
               shared.pending, shared.host_observer)
    out = _Chunked.apply(run, len(tensors), *tensors, *_anchor(block, tensors))
    if not top_k:
        return (*out, None)
    prob_sum, counts, n = out[-3:]
    return (*out[:-3], router_stats(counts, prob_sum, n, top_k))
