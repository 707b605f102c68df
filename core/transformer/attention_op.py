"""Attention under ``torch.compile``: the layer graph sees tensors only.

Eager attention reads the micro-batch's document boundaries as Python ints (``DocLayout``).
Inside a compiled layer those ints would become guards (one recompile per new document
layout), so the compiled path passes the boundaries as tensors instead:

* ``varlen`` (CUDA): torch's ``varlen_attn`` is traced into the graph as it is; ``cu_seqlens``
  is a device tensor whose length is marked dynamic, and the maximum segment length is the
  pack's length ``T`` (a static bound: flash sizes its grid by it and the blocks past a
  document's end return at once), so no per-batch integer reaches the graph.
* ``sdpa`` (CPU): one opaque custom op,
  ``thd::attention``, whose arguments are ``q``, ``k``, ``v`` and the boundaries as a
  *host* tensor ``[2, n + 1]`` (real, padded). The op rebuilds the layout from that host
  tensor (no device read) and runs the eager backend; its backward recomputes the attention
  under autograd (one extra attention forward per layer, the price of an opaque kernel).

``flex`` (compiled by itself) and ``transformer_engine`` (its kernels want device boundaries
and its autograd functions do not run under ``torch.func``) are refused under ``--compile``.
"""
from __future__ import annotations

import torch

from core.packed_seq import PackedSeqParams
from core.transformer.attention_backends import BACKENDS, DocLayout, _varlen_kernel


def _layout_from_host(cu_host: torch.Tensor) -> DocLayout:
    real, padded = (tuple(r) for r in cu_host.tolist())  # a CPU tensor: host memory, no sync
    params = PackedSeqParams(torch.tensor(real, dtype=torch.int32), torch.tensor(padded, dtype=torch.int32),
                             max(b - a for a, b in zip(real[:-1], real[1:])), "thd", real, padded)
    return DocLayout.from_params(params)


@torch.library.custom_op("thd::attention", mutates_args=())
def thd_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_host: torch.Tensor,
                  window: int, scale: float, backend: str) -> torch.Tensor:
    """``BACKENDS[backend]`` over the layout in ``cu_host``; ``window`` 0 means full attention."""
    return BACKENDS[backend](q, k, v, _layout_from_host(cu_host), window or None, scale)


@thd_attention.register_fake
def _(q, k, v, cu_host, window, scale, backend):
    return torch.empty_like(q)


@torch.library.custom_op("thd::attention_backward", mutates_args=())
def thd_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_host: torch.Tensor, window: int, scale: float,
                           backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`thd_attention` by recomputing it under autograd (also opaque)."""
    layout = _layout_from_host(cu_host)
    # torch.func: plain autograd is switched off inside a custom op's implementation
    _, vjp = torch.func.vjp(lambda q, k, v: BACKENDS[backend](q, k, v, layout, window or None, scale), q, k, v)
    return vjp(grad)


@thd_attention_backward.register_fake
def _(grad, q, k, v, cu_host, window, scale, backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, cu_host, window, scale, backend = inputs
    ctx.save_for_backward(q, k, v, cu_host)
    ctx.window, ctx.scale, ctx.backend = window, scale, backend


def _backward(ctx, grad):
    q, k, v, cu_host = ctx.saved_tensors
    dq, dk, dv = thd_attention_backward(grad, q, k, v, cu_host, ctx.window, ctx.scale, ctx.backend)
    return dq, dk, dv, None, None, None, None


thd_attention.register_autograd(_backward, setup_context=_setup)


def compiled_attention(q, k, v, layout: DocLayout, window: int | None, scale: float, backend: str):
    """The attention call a compiled layer makes (see the module docstring)."""
    if backend in ("flex", "transformer_engine"):
        raise ValueError(f"--compile does not support --attention-backend {backend} (use auto: "
                         "varlen on CUDA, sdpa on CPU)")
    if backend == "varlen":
        cu, T = layout.params.cu_seqlens_padded, q.shape[0]
        return _varlen_kernel()(q, k, v, cu, cu, T, T, scale=scale,
                                window_size=(window - 1, 0) if window is not None else (-1, 0),
                                enable_gqa=q.shape[1] != k.shape[1])
    return thd_attention(q, k, v, layout.cu_host, window or 0, scale, backend)
