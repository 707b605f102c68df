"""A pre-norm decoder block on THD input, assembled from core's parts by a family:
``h = x + attn(norm1(x)); out = h + ffn(norm2(h))``, with activation recompute; and
:class:`RecomputeUnit`, the recompute of a block built around one (an MTP depth).

The FFN is a dense SwiGLU (returns a tensor) or an MoE layer (returns ``(tensor, stats)``; it also
takes the valid-token mask); it is registered under the family's own attribute name (``mlp``,
``moe``...) so parameter names stay the published ones. ``rope_key`` selects this block's cos/sin
from the per-layer-type table the model computes once per forward.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from core.memory_mode import RecomputePlacement
from core.moe.layer import MoELayer
from core.moe.overlap import overlapped_forward
from core.transformer.attention_backends import DocLayout
from core.transformer.chunked import ChunkedRecompute, chunked_recompute
from core.transformer.vit import ViTLayer

RECOMPUTE = ("none", "selective", "full")


class _Recomputed:
    """The recompute setting a block reads (``apply_recompute`` sets it from the mode's
    ``RecomputePlacement``, core/memory_mode.py)."""

    recompute_placement: RecomputePlacement = RecomputePlacement()
    chunked: ChunkedRecompute | None = None  # what the rank's chunked blocks share

    @property
    def recompute(self) -> str:
        """The block's granularity: none | selective | full."""
        return self.recompute_placement.granularity

    def _full(self, fn, *args):
        """``fn(*tensors, ropes, layout, valid)`` under full recompute, keeping only its inputs."""
        rc = self.recompute_placement
        if rc.runs_chunked:
            return chunked_recompute(self, fn, args[:-3], *args[-3:], rc.chunks, rc.offload_inputs, self.chunked)
        return checkpoint(fn, *args, use_reentrant=False)


class DecoderBlock(_Recomputed, nn.Module):
    # recompute "full": keep only the input; "selective": drop attention and FFN internals
    overlap_moe: bool = False  # the MoE all-to-alls hidden by a two-chunk schedule (core/moe/overlap.py)

    def __init__(self, input_norm: nn.Module, attention: nn.Module, post_norm: nn.Module, ffn: nn.Module,
                 *, ffn_name: str = "mlp", rope_key: str = "default"):
        super().__init__()
        self.layer_type = rope_key
        self.input_layernorm = input_norm
        self.self_attn = attention
        self.post_attention_layernorm = post_norm
        self.ffn_name = ffn_name
        setattr(self, ffn_name, ffn)

    @property
    def ffn(self) -> nn.Module:
        return getattr(self, self.ffn_name)

    def forward(self, x_TH, ropes: dict, layout: DocLayout, valid_T) -> tuple[torch.Tensor, dict | None]:
        """``(output, MoE statistics or None)``; recompute reruns the maths during backward but
        its statistics are dropped there, so each micro-batch counts once."""
        if self.recompute_placement.full and torch.is_grad_enabled():
            return self._full(self._forward, x_TH, ropes, layout, valid_T)
        return self._forward(x_TH, ropes, layout, valid_T)

    def _forward(self, x_TH, ropes, layout, valid_T):
        if self.overlap_moe:
            return overlapped_forward(self, x_TH, ropes, layout, valid_T)
        h, y = self.attention_block(x_TH, ropes, layout)
        selective = self.recompute_placement.selective and torch.is_grad_enabled()
        ffn = self.ffn
        args = (y, valid_T) if isinstance(ffn, MoELayer) else (y,)
        y = checkpoint(ffn, *args, use_reentrant=False) if selective else ffn(*args)
        y, stats = y if isinstance(y, tuple) else (y, None)
        return h + y, stats

    def attention_block(self, x_TH, ropes, layout):
        """``(residual stream after attention, its post-attention norm)``: the part of the block
        before the FFN (a unit of its own for ``--compile`` when the FFN communicates)."""
        selective = self.recompute_placement.selective and torch.is_grad_enabled()
        h_in = self.input_layernorm(x_TH)
        rope = ropes[self.layer_type]
        attn = (checkpoint(self.self_attn, h_in, rope, layout, use_reentrant=False)
                if selective else self.self_attn(h_in, rope, layout))
        h = x_TH + attn
        return h, self.post_attention_layernorm(h)


class RecomputeUnit(_Recomputed, nn.Module):
    """A block built around decoder blocks (an MTP depth: input norms and projection, a decoder
    block, a head). Under ``full`` recompute the part of its forward it runs through
    :meth:`recomputed` keeps only its inputs (its decoder blocks then recompute nothing of their
    own, or they would run twice); under ``selective`` its decoder blocks drop their attention
    and FFN internals, the rest keeps what it keeps. Statistics returned by the recomputed part
    are those of the forward: the rerun's are dropped (as :class:`DecoderBlock`'s)."""

    def recomputed(self, fn, *args):
        """``fn(*tensors, ropes, layout, valid)``, recomputed under ``full``."""
        if self.recompute_placement.full and torch.is_grad_enabled():
            return self._full(fn, *args)
        return fn(*args)


def _set_recompute(block: nn.Module, rc: RecomputePlacement, shared) -> None:
    outer = isinstance(block, RecomputeUnit)
    if outer:
        block.recompute_placement, block.chunked = rc.block(), shared
    inner = rc.block("none" if outer and rc.full else rc.granularity)
    for m in block.modules():
        if isinstance(m, DecoderBlock):
            m.recompute_placement, m.chunked = inner, shared if inner.full else None


def apply_recompute(chunk: nn.Module, granularity: str | RecomputePlacement, num_layers: int = 0, chunks: int = 1,
                    offload_inputs: bool = False, shared: ChunkedRecompute | None = None) -> None:
    """Set activation recompute on the chunk's blocks (``chunk.blocks()``) as the mode's
    ``RecomputePlacement`` says (``granularity``: that placement, or its granularity with the
    other three given here): its decoder layers (ids >= 0; ``num_layers`` > 0: only its first
    N) and, when all of them are, the extra blocks that follow them (ids < 0, the MTP depths).
    Under ``full``, ``chunks`` > 1 runs each recomputed block a token chunk at a time and
    ``offload_inputs`` keeps its inputs in host memory (``core/transformer/chunked.py``);
    ``shared``: what the rank's chunked blocks share (its offload stream and pending gradients:
    one for all of a rank's chunks), made here if not given. Vision-transformer layers
    (``core/transformer/vit.py``) in the chunk take the granularity too, whole views at a time."""
    rc = granularity if isinstance(granularity, RecomputePlacement) else \
        RecomputePlacement(granularity, num_layers, chunks, offload_inputs)
    if rc.granularity not in RECOMPUTE:
        raise ValueError(f"--recompute-granularity {rc.granularity!r}: expected none, selective or full")
    if rc.runs_chunked and not rc.full:
        raise ValueError("--recompute-chunks and --offload-recompute-inputs need --recompute-granularity full")
    layers = [m for i, m in chunk.blocks() if i >= 0]
    chosen = layers[:rc.num_selected(len(layers))]
    extra = [m for i, m in chunk.blocks() if i < 0] if rc.recomputes_extra(len(layers)) else []
    shared = shared if shared is not None else ChunkedRecompute()
    for block in chosen + extra:
        _set_recompute(block, rc, shared)
    # a vision tower's layers (the first stage of a vision-language model): the same granularity,
    # whole views at a time (token chunks and input offload are the decoder blocks')
    for m in chunk.modules():
        if isinstance(m, ViTLayer):
            m.recompute_placement = RecomputePlacement(rc.granularity)


def recomputes_extra_blocks(num_layers: int, chunk_layers: int) -> bool:
    """Whether :func:`apply_recompute` recomputes the extra blocks of a chunk of
    ``chunk_layers`` decoder layers (``RecomputePlacement.recomputes_extra``)."""
    return RecomputePlacement(num_layers=num_layers).recomputes_extra(chunk_layers)


def pending_grads(chunks: list):
    """The :class:`~core.transformer.chunked.PendingGrads` of the chunks' chunked blocks (None
    without any): what tells the in-backward optimizer that a block's gradient is not final yet."""
    found = {id(m.chunked): m.chunked for c in chunks for m in c.modules()
             if isinstance(m, _Recomputed) and m.chunked is not None and m.recompute_placement.chunked}
    if len(found) > 1:
        raise ValueError("the chunks' blocks were given different ChunkedRecompute objects: pass one to every "
                         "apply_recompute call of the rank (parallelize does)")
    return next(iter(found.values())).pending if found else None
