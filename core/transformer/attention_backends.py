"""Attention kernels on THD input behind one signature.

Every backend takes ``q [T, Hq, D]``, ``k``/``v [T, Hkv, D]`` (GQA: ``Hq % Hkv == 0``), the
micro-batch's :class:`DocLayout`, a sliding window (``None`` for full attention; otherwise the
number of keys a query sees, counting itself) and the softmax scale, and returns ``[T, Hq, D]``.
Attention never crosses a document; padding positions produce zeros (sdpa) or values nobody
reads (their labels are -100 and no real token attends to them).

* ``varlen``: torch's flash ``varlen_attn`` over ``cu_seqlens`` (sliding window, GQA), one
  kernel per layer for the whole pack. CUDA only; the GPU default (``auto``).
* ``sdpa``: exact, a few ``scaled_dot_product_attention`` calls per pack (``sdpa_blocks.py``):
  query blocks against the keys they can see under one banded, block-diagonal mask across
  document boundaries, long documents of full-width layers causal and alone; memory
  O(block x keys a block sees). The CPU default (``auto``) and the reference.
* ``flex``: ``flex_attention`` with a document + causal + window ``BlockMask``, built once per
  micro-batch and window and shared by the chunk's layers (and recompute); compiled on GPU,
  eager and forward-only on CPU.
* ``transformer_engine``: TE's ``DotProductAttention`` with ``qkv_format="thd"``; import-gated.

Documents are laid out by ``cu_seqlens_padded``: a document's padding comes after its real
tokens, so causal attention over the padded segments is exact for every real token.
"""
from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch._dynamo

from core.packed_seq import PackedSeqParams
from core.transformer.sdpa_blocks import sdpa_attention


@dataclass
class DocLayout:
    """A THD micro-batch's documents, built once per chunk forward and shared by its layers:
    host integers from the loader (no device read) and device tensors derived on the device."""

    params: PackedSeqParams
    starts: list      # buffer offset of each document (cu_seqlens_padded[:-1]), host ints
    lengths: list     # real tokens of each document, host ints
    total: int        # T
    cache: dict       # per-micro-batch objects built once and shared (flex BlockMasks, ...)
    cu_host: torch.Tensor | None = None  # [2, n + 1] int64 CPU (real, padded): what a compiled
                                         # layer reads instead of the lists (attention_op.py)
    longest_host: torch.Tensor | None = None  # empty CPU [longest padded segment]: its size is that
                                              # length inside a compiled layer (attention_op.py)
    part_of: "PartOf | None" = None  # a chunk of whole documents of another layout (the MoE
                                     # overlap's), whose rows sdpa computes as the whole's plan

    @classmethod
    def from_params(cls, params: PackedSeqParams) -> "DocLayout":
        cu, padded = params.host_boundaries()
        cu_host = torch.tensor([cu, padded], dtype=torch.int64)
        # the number of documents changes from pack to pack: a compiled graph must not
        # specialise on it (marking costs nothing in eager)
        torch._dynamo.maybe_mark_dynamic(cu_host, 1)
        torch._dynamo.maybe_mark_dynamic(params.cu_seqlens_padded, 0)
        layout = cls(params, list(padded[:-1]), [b - a for a, b in zip(cu[:-1], cu[1:])], padded[-1], {},
                     cu_host)
        layout.longest_host = torch.empty(layout.longest_padded, dtype=torch.uint8)
        torch._dynamo.maybe_mark_dynamic(layout.longest_host, 0)  # nor on the longest document
        return layout

    @property
    def longest_padded(self) -> int:
        """The longest padded document segment: what flash sizes its grid by (host int)."""
        return max((b - a for a, b in zip(self.starts, self.starts[1:] + [self.total])), default=0)

    def doc_ids(self, device) -> torch.Tensor:
        """Document index of every position (padding gets its segment's index), on ``device``."""
        bounds = self.params.cu_seqlens_padded.to(device)
        pos = torch.arange(self.total, device=device, dtype=torch.int32)
        return torch.searchsorted(bounds, pos, right=True) - 1

    def real_end(self, device) -> torch.Tensor:
        """For every position, one past the last real token of its document (``[T]`` int64),
        computed on ``device`` without reading it back."""
        doc = self.doc_ids(device).long()
        starts = self.params.cu_seqlens_padded.to(device).long()[doc]
        cu = self.params.cu_seqlens.to(device).long()
        return starts + (cu[1:] - cu[:-1])[doc]

    def valid_mask(self, device) -> torch.Tensor:
        """True on real tokens, False on padding (``[T]`` bool), vectorised on ``device``; a
        context-parallel shard's comes with it (computed on the whole pack)."""
        if self.params.cp is not None:
            return self.params.cp.valid.to(device)
        return torch.arange(self.total, device=device) < self.real_end(device)


class PartOf:
    """Where a chunk's layout lies in its micro-batch's: ``whole`` (that layout) and ``offset``
    (its first token). A plain object, not a dataclass or tuple: FSDP walks those in a module's
    outputs, and this back-reference (the whole's cache holds the chunk) would be a cycle."""

    __slots__ = ("whole", "offset")

    def __init__(self, whole: DocLayout, offset: int):
        self.whole, self.offset = whole, offset


def _varlen_kernel():
    """torch's flash ``varlen_attn`` (a seam: CPU tests put a reference of its contract here)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


FLASH_DTYPES = (torch.bfloat16, torch.float16)  # all that flash's kernels take


@dataclass(frozen=True)
class VarlenAPI:
    """The keywords this torch's ``varlen_attn`` takes; they arrived over releases, so they are
    read off its signature rather than assumed: ``window_size`` (2.10; 2.9 had ``is_causal``),
    ``enable_gqa`` (2.12: before it, fewer KV heads than query heads go to the flash kernel as
    they are, which supports GQA natively), ``scale``."""

    keywords: frozenset

    @classmethod
    def of(cls, fn) -> "VarlenAPI":
        return cls(frozenset(inspect.signature(fn).parameters))

    def kwargs(self, window: int | None, scale: float, gqa: bool, head_dim: int) -> dict:
        """The keyword arguments of a causal call with ``window`` keys per query (counting the
        query itself; ``None``: every earlier key of the document); ``RuntimeError`` for what
        this torch's ``varlen_attn`` cannot do."""
        kw, out = self.keywords, {}
        if "window_size" in kw:
            out["window_size"] = (window - 1, 0) if window is not None else (-1, 0)
        elif window is None and "is_causal" in kw:
            out["is_causal"] = True
        else:
            raise RuntimeError("this torch's varlen_attn has no window_size (torch >= 2.10 has it): "
                               "use --attention-backend sdpa or flex")
        if "scale" in kw:
            out["scale"] = scale
        elif abs(scale * head_dim ** 0.5 - 1.0) > 1e-12:  # only the kernel's default can run
            raise RuntimeError(f"this torch's varlen_attn has no scale keyword and the softmax scale "
                               f"{scale:g} is not 1/sqrt({head_dim}): use --attention-backend sdpa or flex")
        if gqa and "enable_gqa" in kw:
            out["enable_gqa"] = True
        return out


def _detect_varlen() -> VarlenAPI | None:
    try:
        return VarlenAPI.of(_varlen_kernel())
    except ImportError:
        return None


VARLEN = _detect_varlen()  # None: this torch has no varlen_attn


def call_varlen(q, k, v, cu: torch.Tensor, longest, window: int | None, scale: float) -> torch.Tensor:
    """One flash ``varlen_attn`` over the segments of ``cu`` (int32 on the tensors' device),
    ``longest`` the longest segment (a host int, or a traced size under ``--compile``): the
    keywords this torch has, and a clear error for an input flash cannot take."""
    if VARLEN is None:
        raise RuntimeError("--attention-backend varlen needs torch.nn.attention.varlen (torch >= 2.10)")
    if q.dtype not in FLASH_DTYPES:
        raise ValueError(f"--attention-backend varlen (flash) computes in bf16 or fp16, got {q.dtype}: "
                         "add --bf16, or use --attention-backend auto (sdpa for fp32)")
    kw = VARLEN.kwargs(window, scale, q.shape[1] != k.shape[1], q.shape[-1])
    return _varlen_kernel()(q, k, v, cu, cu, longest, longest, **kw)


def varlen_attention(q, k, v, layout: DocLayout, window: int | None, scale: float) -> torch.Tensor:
    """Flash attention over the pack's padded document boundaries: int32 ``cu_seqlens`` on the
    tensors' device, the longest segment as a host int (no device read), ``window`` keys
    counting the query as ``window_size=(window - 1, 0)``, GQA without expanding k and v."""
    key = ("varlen", q.device)
    if key not in layout.cache:
        layout.cache[key] = (layout.params.cu_seqlens_padded.to(q.device, torch.int32), layout.longest_padded)
    cu, longest = layout.cache[key]
    return call_varlen(q, k, v, cu, longest, window, scale)


def _block_mask(layout: DocLayout, window: int | None, device):
    """The flex ``BlockMask`` of this micro-batch and window, made once and shared by layers."""
    key = ("flex", window, device)
    if key not in layout.cache:
        from torch.nn.attention.flex_attention import create_block_mask

        doc = layout.doc_ids(device)

        def mask_mod(b, h, qi, ki):
            keep = (doc[qi] == doc[ki]) & (qi >= ki)
            return keep & (qi - ki < window) if window is not None else keep

        layout.cache[key] = create_block_mask(mask_mod, None, None, layout.total, layout.total, device=device)
    return layout.cache[key]


def flex_attention_thd(q, k, v, layout: DocLayout, window: int | None, scale: float) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    block = _block_mask(layout, window, q.device)
    fn = flex_attention if q.device.type == "cpu" else _compiled_flex()
    with warnings.catch_warnings():  # eager flex on CPU warns that it is unfused
        warnings.simplefilter("ignore")
        o = fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
               block_mask=block, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return o[0].transpose(0, 1)


_COMPILED: dict = {}


def _compiled_flex():
    if "flex" not in _COMPILED:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED["flex"] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED["flex"]


def transformer_engine_attention(q, k, v, layout: DocLayout, window: int | None, scale: float):
    """Thin adapter to Transformer Engine (GPU only; not exercised by the CPU tests).

    TE's window is ``(left, right)`` keys excluding the query, hence ``window - 1``.
    """
    try:
        from transformer_engine.pytorch import DotProductAttention
    except ImportError as e:
        raise ImportError("--attention-backend transformer_engine needs Transformer Engine "
                          "(pip install .[te] on a CUDA machine)") from e
    key = (q.shape[1], k.shape[1], q.shape[2], window, scale)
    if key not in _COMPILED:
        _COMPILED[key] = DotProductAttention(
            q.shape[1], q.shape[2], num_gqa_groups=k.shape[1], qkv_format="thd",
            attn_mask_type="padding_causal", softmax_scale=scale,
            window_size=(window - 1, 0) if window is not None else (-1, 0))
    p = layout.params
    o = _COMPILED[key](q, k, v, cu_seqlens_q=p.cu_seqlens, cu_seqlens_kv=p.cu_seqlens,
                       cu_seqlens_q_padded=p.cu_seqlens_padded, cu_seqlens_kv_padded=p.cu_seqlens_padded,
                       max_seqlen_q=p.max_seqlen, max_seqlen_kv=p.max_seqlen)
    return o.view_as(q)


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """``auto``: ``varlen`` on CUDA for bf16 / fp16 inputs (all that flash takes) where this
    torch has it, ``sdpa`` elsewhere (fp32 on CUDA included: ``varlen`` would refuse it)."""
    if name == "auto":
        flash = dtype is None or dtype in FLASH_DTYPES
        return "varlen" if device.type == "cuda" and flash and VARLEN is not None else "sdpa"
    return name


BACKENDS: dict[str, Callable] = {
    "varlen": varlen_attention,
    "sdpa": sdpa_attention,
    "flex": flex_attention_thd,
    "transformer_engine": transformer_engine_attention,
}

ATTENTION_BACKENDS = ("auto", *BACKENDS)  # what --attention-backend accepts
