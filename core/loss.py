"""Linear + cross-entropy over a vocabulary, a tile of tokens x vocabulary at a time: the summed
token loss of ``F.cross_entropy(F.linear(h, W).float(), labels, ignore_index=-100,
reduction="sum")`` and its gradients, without ever holding ``[T, vocab]`` logits.

Forward: for each tile ``[rows, cols]`` (tokens x vocabulary) the fp32 logits ``h[r] @ W[c].T``
(exact products of the inputs summed in fp32: the GEMM writes fp32 where the device can, CUDA's
``out_dtype``, else the operands are upcast), folded into a running max and sum of exponentials
per token (an online logsumexp), and the target's logit picked where its column falls in the
tile. Kept for backward: the per-token ``logsumexp`` (fp32 ``[T]``) beside the inputs ``h``,
``W`` and the labels; nothing of vocabulary size.

Backward: each tile's logits are recomputed (one more forward GEMM of the head: the price of
not keeping them), turned in place into ``(softmax - onehot) * grad * valid`` from the saved
logsumexp, cast to the GEMMs' operand dtype (the inputs' on a GPU, as autograd of a bf16
``F.linear`` multiplies too; fp32 on a CPU, which upcasts bf16 operands), and multiplied into
``dh`` (fp32 accumulator ``[T, H]``, returned in h's dtype) and into the vocabulary block's
``dW`` (fp32 accumulator ``[cols, H]``, written into dW in W's dtype once the block's tokens are
done). Vocabulary blocks run outside, token blocks inside, so only one block of dW is ever
fp32; dh's fp32 accumulator is a ``[T, H]`` tensor (none when h is fp32: dh is it).

Tile shape (:func:`tile_shape`): ``cols`` so that one vocabulary block's fp32 dW accumulator
``[cols, H]`` is at most ``TILE_BYTES`` (128 MiB), ``rows`` so that one fp32 tile ``[rows,
cols]`` is at most 128 MiB too. Step-3.7-Flash (H 4096, vocab 128,896): tiles of 4096 tokens x
8192 entries, 16 vocabulary blocks, 8 token blocks at T = 32768. Why 128 MiB: at the peak of
the backward the tile, its copy in W's dtype, the dW block and the GEMM result added into it
hold 0.34 GB beyond dh's fp32 accumulator (0.54 GB at T = 32768): 0.87 GB in all against 16.9
GB of fp32 logits (``benchmarks/bench_loss.py``), whatever T beyond the ``[T, H]`` terms; and a
``4096 x 4096 x 8192`` GEMM is large enough to run at a GPU's full rate (per pass each weight
block is read 8 times and each token block 16 times: ~13 GB, a few ms of HBM, against ~35 TFLOP).

No tensor value is read by the host: tile bounds come from the shapes, the target count stays a
tensor. The two passes are opaque custom ops (``thd::linear_cross_entropy`` and its backward,
as ``core/transformer/attention_op.py``), so a compiled block holding a head stays one graph and
nothing inside the loop is traced, unrolled or fused away; they run under ``torch.no_grad()``
(only the forward) and under ``torch.utils.checkpoint`` (the saved tensors go through its hooks).
"""
from __future__ import annotations

import torch

IGNORE_INDEX = -100
TILE_BYTES = 128 * 2 ** 20
F32 = 4
_OUT_DTYPE: dict = {}  # (device type, dtype) -> the device's GEMM writes fp32 from these inputs


def tile_shape(T: int, V: int, H: int, budget: int | None = None) -> tuple[int, int]:
    """``(rows, cols)``: vocabulary blocks of ``cols`` (fp32 ``[cols, H]`` within ``budget``,
    default ``TILE_BYTES``; a multiple of 128 where the vocabulary is larger), token blocks of
    ``rows`` (fp32 ``[rows, cols]`` within ``budget``)."""
    budget = budget or TILE_BYTES
    cols = max(128, budget // (F32 * H) // 128 * 128)
    cols = min(V, cols)
    rows = max(1, min(T, budget // (F32 * cols)))
    return rows, cols


def _out_dtype_gemm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` runs for ``dtype`` inputs here."""
    key = (device.type, dtype)
    if key not in _OUT_DTYPE:
        try:
            a = torch.ones(2, 2, device=device, dtype=dtype)
            _OUT_DTYPE[key] = torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, NotImplementedError, TypeError):
            _OUT_DTYPE[key] = False
    return _OUT_DTYPE[key]


def _operand_dtype(h: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """The dtype the GEMMs read: the inputs' own when they agree (on an accelerator, or fp32);
    fp32 otherwise (the CPU's bf16 GEMMs have no fp32 output: the operands are upcast, h once,
    W a block at a time)."""
    if h.dtype == w.dtype and (h.dtype == torch.float32 or h.device.type != "cpu"):
        return h.dtype
    return torch.float32


def _gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in fp32: written in fp32 by the GEMM where it can (``out_dtype``); a torch
    without it rounds the product to the inputs' dtype first (what ``F.linear`` gives today)."""
    if a.dtype == torch.float32:
        return a @ b
    if _out_dtype_gemm(a.device, a.dtype):
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


def _add_gemm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` with ``out`` fp32 (in place, no temporary, when the operands are fp32)."""
    if a.dtype == torch.float32:
        out.addmm_(a, b)
    else:
        out += _gemm(a, b)


def _blocks(n: int, size: int):
    return [(s, min(s + size, n)) for s in range(0, n, size)]


def _in_block(labels_T: torch.Tensor, v0: int, cols: int):
    """Each row's target column inside the vocabulary block starting at ``v0`` (clamped), and
    whether the target is in the block (never for the ignore index)."""
    col = labels_T - v0
    inside = (col >= 0) & (col < cols)
    return col.clamp(0, cols - 1).unsqueeze(1), inside


def chunked_forward(h_TH, w_VH, labels_T, rows: int, cols: int):
    """``(summed token loss, logsumexp [T])``, both fp32; see the module docstring."""
    T, V = h_TH.shape[0], w_VH.shape[0]
    dt = _operand_dtype(h_TH, w_VH)
    h = h_TH.to(dt)
    run_max = torch.full((T,), float("-inf"), device=h.device)
    run_sum = torch.zeros(T, device=h.device)
    target = torch.zeros(T, device=h.device)
    for v0, v1 in _blocks(V, cols):
        w_t = w_VH[v0:v1].to(dt).t()
        for r0, r1 in _blocks(T, rows):
            z = _gemm(h[r0:r1], w_t)                            # fp32 logits [rows, cols]
            col, inside = _in_block(labels_T[r0:r1], v0, v1 - v0)
            target[r0:r1] += torch.where(inside, z.gather(1, col).squeeze(1), 0.0)
            top = z.amax(1)
            total = z.sub_(top.unsqueeze(1)).exp_().sum(1)
            m_old = run_max[r0:r1]
            m_new = torch.maximum(m_old, top)
            run_sum[r0:r1] = run_sum[r0:r1] * torch.exp(m_old - m_new) + total * torch.exp(top - m_new)
            run_max[r0:r1] = m_new
    lse = run_max + torch.log(run_sum)
    loss = torch.where(labels_T != IGNORE_INDEX, lse - target, 0.0).sum()
    return loss, lse


def chunked_backward(grad, h_TH, w_VH, labels_T, lse_T, rows: int, cols: int, need_dh: bool = True,
                     need_dw: bool = True):
    """``(dh in h's dtype, dW in W's dtype)`` of the summed loss scaled by ``grad`` (an fp32
    scalar tensor); an empty tensor for one not needed."""
    T, V, H = h_TH.shape[0], w_VH.shape[0], h_TH.shape[1]
    dt = _operand_dtype(h_TH, w_VH)
    h = h_TH.to(dt)
    scale = torch.where(labels_T != IGNORE_INDEX, grad.float(), 0.0).unsqueeze(1)  # [T, 1]
    dh = torch.zeros(T, H, device=h.device) if need_dh else None
    dw = torch.empty_like(w_VH) if need_dw else None
    acc = dw if dw is not None and dw.dtype == torch.float32 else None
    buf = torch.empty(min(cols, V), H, device=h.device) if need_dw and acc is None else None
    for v0, v1 in _blocks(V, cols):
        w_blk = w_VH[v0:v1].to(dt)
        dw_blk = acc[v0:v1] if acc is not None else (buf[:v1 - v0] if buf is not None else None)
        if dw_blk is not None:
            dw_blk.zero_()
        for r0, r1 in _blocks(T, rows):
            p = _gemm(h[r0:r1], w_blk.t())                      # the tile's logits again
            p.sub_(lse_T[r0:r1].unsqueeze(1)).exp_()            # softmax
            col, inside = _in_block(labels_T[r0:r1], v0, v1 - v0)
            p.scatter_add_(1, col, -inside.float().unsqueeze(1))  # minus the one-hot target
            p = p.mul_(scale[r0:r1]).to(dt)
            if dh is not None:
                _add_gemm(dh[r0:r1], p, w_blk)
            if dw_blk is not None:
                _add_gemm(dw_blk, p.t(), h[r0:r1])
        if dw is not None and acc is None:
            dw[v0:v1].copy_(dw_blk)
    empty = h_TH.new_empty(0)
    dh = dh.to(h_TH.dtype) if dh is not None else empty
    return dh, dw if dw is not None else empty


@torch.library.custom_op("thd::linear_cross_entropy", mutates_args=())
def _linear_ce(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, rows: int,
               cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    return chunked_forward(h, w, labels, rows, cols)


@_linear_ce.register_fake
def _(h, w, labels, rows, cols):
    return h.new_empty((), dtype=torch.float32), h.new_empty(h.shape[0], dtype=torch.float32)


@torch.library.custom_op("thd::linear_cross_entropy_backward", mutates_args=())
def _linear_ce_backward(grad: torch.Tensor, h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor,
                        lse: torch.Tensor, rows: int, cols: int, need_dh: bool,
                        need_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return chunked_backward(grad, h, w, labels, lse, rows, cols, need_dh, need_dw)


@_linear_ce_backward.register_fake
def _(grad, h, w, labels, lse, rows, cols, need_dh, need_dw):
    return h.new_empty(h.shape if need_dh else (0,)), w.new_empty(w.shape if need_dw else (0,))


def _setup(ctx, inputs, output):
    h, w, labels, rows, cols = inputs
    ctx.save_for_backward(h, w, labels, output[1])
    ctx.rows, ctx.cols = rows, cols
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _backward(ctx, grad, _grad_lse):
    h, w, labels, lse = ctx.saved_tensors
    need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dh, dw = _linear_ce_backward(grad, h, w, labels, lse, ctx.rows, ctx.cols, need_dh, need_dw)
    return dh if need_dh else None, dw if need_dw else None, None, None, None


_linear_ce.register_autograd(_backward, setup_context=_setup)


def linear_cross_entropy(h_TH: torch.Tensor, w_VH: torch.Tensor, labels_T: torch.Tensor, *,
                         rows: int | None = None, cols: int | None = None):
    """``(summed token loss, number of targets)``: fp32 scalar and int64 scalar tensors, the loss
    differentiable in ``h_TH`` and ``w_VH``. ``rows`` / ``cols``: the tile (default
    :func:`tile_shape`)."""
    T, H = h_TH.shape
    default_rows, default_cols = tile_shape(T, w_VH.shape[0], H)
    loss, _ = _linear_ce(h_TH, w_VH, labels_T, rows or default_rows, cols or default_cols)
    return loss, (labels_T != IGNORE_INDEX).sum()
